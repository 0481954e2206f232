//! RabbitMQ through lapin (feature `amqp`).
//!
//! Topology ([`AmqpTopology::declare`], idempotent, run by publishers and subscribers alike so
//! whoever starts first creates it):
//!
//! - a durable topic exchange (e.g. `payments`) and a durable quorum queue (e.g. `receipts`)
//!   bound to it with a routing key pattern (e.g. `payment.created`);
//! - the queue dead-letters into the fanout exchange `<queue>.dead-letter` and its durable
//!   queue `<queue>.dead`: messages the consumer rejects (poison) and messages redelivered
//!   more than the delivery limit (handler keeps failing) end up there, never retried forever.
//!
//! Publishing: persistent messages (`delivery_mode` 2) with `message_id`, `mandatory` (an
//! unroutable message is an error, not a silent drop) and publisher confirms.
//! Consuming: manual acks with a prefetch; a retry is a `nack` with requeue.
//!
//! Publishers and subscribers own their connection and open a new one when it fails (see
//! [`AmqpPublisher`] and [`AmqpSubscriber`]); connections ask for a heartbeat of
//! [`DEFAULT_HEARTBEAT_SECS`] unless the URL sets one, so a silent peer is noticed.

use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use lapin::{
    options::{
        BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions,
        BasicQosOptions, BasicRejectOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
        QueueBindOptions, QueueDeclareOptions,
    },
    protocol::{AMQPErrorKind, AMQPSoftError},
    types::{AMQPValue, FieldTable, ShortString},
    uri::AMQPUri,
    BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind,
};
use tokio::{sync::Mutex, time::Instant};

use super::{
    deadline, within, Backoff, BrokerError, Delivery, OutgoingMessage, Publisher, Refusal,
    Subscriber, Verdict, DEFAULT_CALL_TIMEOUT,
};

/// The client library, for what this module does not wrap (e.g. deleting a test's queues).
pub use lapin;

const BROKER: &str = "amqp";

/// Where messages go: exchange, queue and binding. See the [module docs](self).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmqpTopology {
    /// The durable topic exchange publishers send to.
    pub exchange: String,
    /// The durable quorum queue consumers read.
    pub queue: String,
    /// The binding key of the queue on the exchange (a topic pattern).
    pub binding: String,
    /// Deliveries of one message before RabbitMQ dead-letters it (`x-delivery-limit`).
    pub delivery_limit: u32,
}

impl AmqpTopology {
    /// Exchange `exchange`, queue `queue` bound with `binding`, delivery limit 20: above the
    /// [inbox consumer](crate::inbox::Consumer)'s `max_attempts`, since a consumer that
    /// dies holding prefetched messages also counts as a delivery of each.
    pub fn new(
        exchange: impl Into<String>,
        queue: impl Into<String>,
        binding: impl Into<String>,
    ) -> Self {
        Self {
            exchange: exchange.into(),
            queue: queue.into(),
            binding: binding.into(),
            delivery_limit: 20,
        }
    }

    /// The fanout exchange dead letters go to: `<queue>.dead-letter`.
    pub fn dead_letter_exchange(&self) -> String {
        format!("{}.dead-letter", self.queue)
    }

    /// The queue that keeps dead letters for inspection: `<queue>.dead`.
    pub fn dead_letter_queue(&self) -> String {
        format!("{}.dead", self.queue)
    }

    /// Connects, opens a channel and [declares](Self::declare) the topology on it.
    pub async fn open(&self, url: &str) -> Result<(Connection, Channel), BrokerError> {
        let connection = connect(url).await?;
        let declared = async {
            let channel = connection
                .create_channel()
                .await
                .map_err(|e| failed("open a channel", e))?;
            self.declare(&channel).await?;
            Ok(channel)
        };
        match declared.await {
            Ok(channel) => Ok((connection, channel)),
            Err(error) => {
                abandon(connection);
                Err(error)
            }
        }
    }

    /// Declares everything (idempotent). Fails if the queue exists with other arguments
    /// (for example as a classic queue): delete it or pick another name.
    pub async fn declare(&self, channel: &Channel) -> Result<(), BrokerError> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        let durable_queue = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let dlx = self.dead_letter_exchange();
        let dead = self.dead_letter_queue();
        let declare = |e| failed("declare the topology", e);
        channel
            .exchange_declare(&dlx, ExchangeKind::Fanout, durable, FieldTable::default())
            .await
            .map_err(declare)?;
        channel
            .queue_declare(&dead, durable_queue, FieldTable::default())
            .await
            .map_err(declare)?;
        channel
            .queue_bind(
                &dead,
                &dlx,
                "",
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(declare)?;
        channel
            .exchange_declare(
                &self.exchange,
                ExchangeKind::Topic,
                durable,
                FieldTable::default(),
            )
            .await
            .map_err(declare)?;
        let mut arguments = FieldTable::default();
        arguments.insert("x-queue-type".into(), long_string("quorum"));
        arguments.insert("x-dead-letter-exchange".into(), long_string(&dlx));
        arguments.insert(
            "x-delivery-limit".into(),
            AMQPValue::LongLongInt(i64::from(self.delivery_limit)),
        );
        channel
            .queue_declare(&self.queue, durable_queue, arguments)
            .await
            .map_err(declare)?;
        channel
            .queue_bind(
                &self.queue,
                &self.exchange,
                &self.binding,
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(declare)?;
        Ok(())
    }
}

fn long_string(value: &str) -> AMQPValue {
    AMQPValue::LongString(value.into())
}

/// The heartbeat asked for when the URL names none: a connection that went silent (a
/// partition, a broker that hangs) is given up after about twice this, instead of RabbitMQ's
/// 60 s proposal.
pub const DEFAULT_HEARTBEAT_SECS: u16 = 10;

/// Opens a connection that runs on the current tokio runtime, with a heartbeat of
/// [`DEFAULT_HEARTBEAT_SECS`] unless the URL sets one (`?heartbeat=N`).
pub async fn connect(url: &str) -> Result<Connection, BrokerError> {
    let mut uri: AMQPUri = url
        .parse()
        .map_err(|e: String| BrokerError::Misconfigured {
            broker: BROKER,
            action: "parse the URL",
            source: e.into(),
        })?;
    uri.query.heartbeat.get_or_insert(DEFAULT_HEARTBEAT_SECS);
    let properties = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio);
    Connection::connect_uri(uri, properties)
        .await
        .map_err(|e| failed("connect", e))
}

/// A lapin error as a [`BrokerError`]: RabbitMQ refusing access or an object's arguments
/// (`ACCESS_REFUSED`, `PRECONDITION_FAILED`) is a configuration to fix, anything else may pass.
fn failed(action: &'static str, error: lapin::Error) -> BrokerError {
    let permanent = matches!(
        &error,
        lapin::Error::ProtocolError(e) if matches!(
            e.kind(),
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED | AMQPSoftError::PRECONDITIONFAILED)
        )
    );
    BrokerError::failed(BROKER, action, permanent, error)
}

/// Closes a connection that failed or is given up, without waiting for it: a dead peer would
/// hold the caller until the close times out.
fn abandon(connection: Connection) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            connection.close(320, "session given up; reconnecting"),
        )
        .await;
    });
}

/// A publisher's connection and confirm-mode channel, while they work.
struct PublishSession {
    connection: Connection,
    channel: Channel,
}

/// What a publisher keeps between batches: its session, if it has one, and the backoff of
/// its reconnections.
struct PublishState {
    session: Option<PublishSession>,
    backoff: Backoff,
    /// When the next reconnection may start (after one failed).
    next_connect: Option<Instant>,
}

/// Publishes to the topology's exchange with the message's topic as routing key, and waits
/// for publisher confirms.
///
/// It owns its connection: when a batch fails (the broker restarted, the connection dropped,
/// a heartbeat was missed, the channel was closed, the time limit passed) the session is
/// dropped, and the next batch opens a new one (connection, channel, topology, confirm mode),
/// after a jittered [`Backoff`] when reconnecting failed too. The relay keeps the failed
/// batch's rows unsent and publishes them again.
pub struct AmqpPublisher {
    url: String,
    topology: AmqpTopology,
    state: Mutex<PublishState>,
    timeout: Duration,
}

impl AmqpPublisher {
    /// Connects, declares `topology` and enables publisher confirms; fails if the broker
    /// cannot be reached now (retry it, or start anyway with [`lazy`](Self::lazy)).
    pub async fn connect(url: &str, topology: &AmqpTopology) -> Result<Self, BrokerError> {
        let publisher = Self::lazy(url, topology);
        let session = deadline(
            BROKER,
            "connect",
            publisher.timeout,
            open_publishing(url, topology),
        )
        .await?;
        publisher.state.lock().await.session = Some(session);
        Ok(publisher)
    }

    /// A publisher that connects on its first batch (and fails that batch if the broker
    /// cannot be reached then).
    pub fn lazy(url: &str, topology: &AmqpTopology) -> Self {
        Self {
            url: url.to_owned(),
            topology: topology.clone(),
            state: Mutex::new(PublishState {
                session: None,
                backoff: Backoff::default(),
                next_connect: None,
            }),
            timeout: DEFAULT_CALL_TIMEOUT,
        }
    }

    /// The time limit of one batch, publishes and confirms, and of a reconnection (default
    /// [`DEFAULT_CALL_TIMEOUT`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The backoff between reconnections (default [`Backoff::default`]: 100 ms doubling up
    /// to 5 s).
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.state.get_mut().backoff = backoff;
        self
    }

    /// The session's channel, opening a new session first if there is none.
    async fn channel(&self, state: &mut PublishState) -> Result<Channel, BrokerError> {
        if let Some(session) = &state.session {
            if session.connection.status().connected() && session.channel.status().connected() {
                return Ok(session.channel.clone());
            }
            // Closed under us (a broker restart, a missed heartbeat, a channel error): the
            // batch goes to a new session rather than failing on the old one.
            if let Some(dead) = state.session.take() {
                abandon(dead.connection);
            }
        }
        if let Some(at) = state.next_connect {
            tokio::time::sleep_until(at).await;
        }
        match deadline(
            BROKER,
            "connect",
            self.timeout,
            open_publishing(&self.url, &self.topology),
        )
        .await
        {
            Ok(session) => {
                let channel = session.channel.clone();
                state.session = Some(session);
                state.next_connect = None;
                tracing::info!(exchange = %self.topology.exchange, "amqp: publisher connected");
                Ok(channel)
            }
            Err(error) => {
                state.next_connect = Some(Instant::now() + state.backoff.next_delay());
                Err(error)
            }
        }
    }
}

/// A connection with the topology declared and a channel in confirm mode.
async fn open_publishing(
    url: &str,
    topology: &AmqpTopology,
) -> Result<PublishSession, BrokerError> {
    let (connection, channel) = topology.open(url).await?;
    if let Err(error) = channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
    {
        abandon(connection);
        return Err(failed("enable publisher confirms", error));
    }
    Ok(PublishSession {
        connection,
        channel,
    })
}

/// Publishes `messages` on `channel` (in confirm mode) and waits for every confirm.
async fn publish_all(
    channel: &Channel,
    exchange: &str,
    messages: &[OutgoingMessage],
) -> Result<Vec<Verdict>, BrokerError> {
    let publish = |e| failed("publish", e);
    // All publishes first, then all confirms: one round trip per batch, not per message,
    // and one channel keeps their order.
    let mut confirms = Vec::with_capacity(messages.len());
    for message in messages {
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(ShortString::from(message.id.as_str()))
            .with_content_type("application/json".into());
        let confirm = channel
            .basic_publish(
                exchange,
                &message.topic,
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &message.payload,
                properties,
            )
            .await
            .map_err(publish)?;
        confirms.push(confirm);
    }
    let mut verdicts = Vec::with_capacity(confirms.len());
    for confirm in confirms {
        let confirmation = confirm.await.map_err(publish)?;
        verdicts.push(if confirmation.is_nack() {
            Err(Refusal::new(BROKER, "publisher nack"))
        } else if confirmation.take_message().is_some() {
            Err(Refusal::new(BROKER, "no queue is bound to its routing key"))
        } else {
            Ok(())
        });
    }
    Ok(verdicts)
}

#[async_trait]
impl Publisher for AmqpPublisher {
    async fn publish_confirmed(
        &self,
        messages: &[OutgoingMessage],
    ) -> Result<Vec<Verdict>, BrokerError> {
        let mut state = self.state.lock().await;
        let batch = async {
            let channel = self.channel(&mut state).await?;
            publish_all(&channel, &self.topology.exchange, messages).await
        };
        let result = deadline(BROKER, "publish", self.timeout, batch).await;
        match &result {
            Ok(_) => state.backoff.reset(),
            // Whatever failed, this session is not trusted with the next batch.
            Err(_) => {
                if let Some(session) = state.session.take() {
                    abandon(session.connection);
                }
            }
        }
        result
    }

    async fn close(&self) {
        let session = self.state.lock().await.session.take();
        if let Some(session) = session {
            let _ =
                tokio::time::timeout(self.timeout, session.connection.close(200, "relay stopped"))
                    .await;
        }
    }
}

/// Consumes the topology's queue with manual acks.
///
/// It owns its connection: when the session fails (the broker restarted, the connection
/// dropped, a heartbeat was missed, the channel or the consumer was cancelled),
/// [`next`](Subscriber::next) opens a new one (connection, topology, prefetch, consumer) after
/// a jittered [`Backoff`], and goes on. The deliveries of the lost session go back to the
/// queue by themselves; settling them fails harmlessly.
pub struct AmqpSubscriber {
    url: String,
    topology: AmqpTopology,
    prefetch: u16,
    session: Option<(Connection, lapin::Consumer)>,
    backoff: Backoff,
    timeout: Duration,
}

impl AmqpSubscriber {
    /// Connects, declares `topology` and starts consuming its queue with at most `prefetch`
    /// unacknowledged deliveries at once; fails if the broker cannot be reached now.
    pub async fn connect(
        url: &str,
        topology: &AmqpTopology,
        prefetch: u16,
    ) -> Result<Self, BrokerError> {
        let mut subscriber = Self {
            url: url.to_owned(),
            topology: topology.clone(),
            prefetch: prefetch.max(1),
            session: None,
            backoff: Backoff::default(),
            timeout: DEFAULT_CALL_TIMEOUT,
        };
        subscriber.session = Some(subscriber.open().await?);
        Ok(subscriber)
    }

    /// The backoff between reconnections (default [`Backoff::default`]: 100 ms doubling up
    /// to 5 s).
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    async fn open(&self) -> Result<(Connection, lapin::Consumer), BrokerError> {
        let session = async {
            let (connection, channel) = self.topology.open(&self.url).await?;
            let consumer = async {
                channel
                    .basic_qos(self.prefetch, BasicQosOptions::default())
                    .await
                    .map_err(|e| failed("set the prefetch", e))?;
                channel
                    .basic_consume(
                        &self.topology.queue,
                        "",
                        BasicConsumeOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|e| failed("consume", e))
            };
            match consumer.await {
                Ok(consumer) => Ok((connection, consumer)),
                Err(error) => {
                    abandon(connection);
                    Err(error)
                }
            }
        };
        deadline(BROKER, "connect", self.timeout, session).await
    }
}

#[async_trait]
impl Subscriber for AmqpSubscriber {
    type Delivery = AmqpDelivery;

    async fn next(&mut self) -> Result<AmqpDelivery, BrokerError> {
        loop {
            let Some((_, consumer)) = &mut self.session else {
                match self.open().await {
                    Ok(session) => {
                        tracing::info!(queue = %self.topology.queue, "amqp: consuming again");
                        self.session = Some(session);
                    }
                    Err(error) if error.is_permanent() => return Err(error),
                    Err(error) => {
                        tracing::warn!(error = %super::error_chain(&error), "amqp: reconnecting failed; trying again");
                        self.backoff.wait().await;
                    }
                }
                continue;
            };
            let error = match consumer.next().await {
                Some(Ok(delivery)) => {
                    self.backoff.reset();
                    return Ok(AmqpDelivery {
                        delivery,
                        timeout: self.timeout,
                    });
                }
                Some(Err(error)) => error.to_string(),
                None => "the consumer was cancelled".to_owned(),
            };
            tracing::warn!(%error, queue = %self.topology.queue, "amqp: the session ended; reconnecting");
            if let Some((connection, _)) = self.session.take() {
                abandon(connection);
            }
            self.backoff.wait().await;
        }
    }

    async fn close(self) {
        // Deliveries still unacknowledged go back to the queue.
        if let Some((connection, _)) = self.session {
            let _ =
                tokio::time::timeout(self.timeout, connection.close(200, "consumer stopped")).await;
        }
    }
}

/// A RabbitMQ delivery.
pub struct AmqpDelivery {
    delivery: lapin::message::Delivery,
    timeout: Duration,
}

#[async_trait]
impl Delivery for AmqpDelivery {
    fn message_id(&self) -> Option<&str> {
        self.delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str())
    }

    fn payload(&self) -> &[u8] {
        &self.delivery.data
    }

    fn delivery_count(&self) -> u32 {
        // Quorum queues count earlier deliveries in `x-delivery-count` (not every cause on
        // every RabbitMQ version); `redelivered` says there was at least one.
        let earlier = self
            .delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|headers| headers.inner().get("x-delivery-count"))
            .and_then(|value| match value {
                AMQPValue::LongLongInt(n) => u32::try_from(*n).ok(),
                AMQPValue::LongInt(n) => u32::try_from(*n).ok(),
                AMQPValue::LongUInt(n) => Some(*n),
                _ => None,
            })
            .unwrap_or(0);
        let earlier = if self.delivery.redelivered {
            earlier.max(1)
        } else {
            earlier
        };
        earlier.saturating_add(1)
    }

    async fn ack(&self) -> Result<(), BrokerError> {
        let ack = self.delivery.ack(BasicAckOptions::default());
        within(BROKER, "ack", self.timeout, ack).await
    }

    async fn retry(&self, delay: Duration) -> Result<(), BrokerError> {
        // RabbitMQ has no delayed requeue: wait here (holding only the delivery, no database
        // connection), then requeue.
        tokio::time::sleep(delay).await;
        let nack = self.delivery.nack(BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        });
        within(BROKER, "nack", self.timeout, nack).await
    }

    async fn dead_letter(&self, _reason: &str) -> Result<(), BrokerError> {
        // The reason is in the consumer's log line; RabbitMQ's `x-death` header keeps the queue.
        let reject = self.delivery.reject(BasicRejectOptions { requeue: false });
        within(BROKER, "reject", self.timeout, reject).await
    }
}
