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

use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use lapin::{
    options::{
        BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions,
        BasicQosOptions, BasicRejectOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
        QueueBindOptions, QueueDeclareOptions,
    },
    types::{AMQPValue, FieldTable, ShortString},
    BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind,
};

use super::{
    deadline, within, BrokerError, Delivery, OutgoingMessage, Publisher, Refusal, Subscriber,
    Verdict, DEFAULT_CALL_TIMEOUT,
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
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| BrokerError::broker(BROKER, "open a channel", e))?;
        self.declare(&channel).await?;
        Ok((connection, channel))
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
        let declare = |e| BrokerError::broker(BROKER, "declare the topology", e);
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

/// Opens a connection that runs on the current tokio runtime.
pub async fn connect(url: &str) -> Result<Connection, BrokerError> {
    let properties = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio);
    Connection::connect(url, properties)
        .await
        .map_err(|e| BrokerError::broker(BROKER, "connect", e))
}

/// Publishes to the topology's exchange with the message's topic as routing key, and waits
/// for publisher confirms.
pub struct AmqpPublisher {
    connection: Connection,
    channel: Channel,
    exchange: String,
    timeout: Duration,
}

impl AmqpPublisher {
    /// Connects, declares `topology` and enables publisher confirms.
    pub async fn connect(url: &str, topology: &AmqpTopology) -> Result<Self, BrokerError> {
        let (connection, channel) = topology.open(url).await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| BrokerError::broker(BROKER, "enable publisher confirms", e))?;
        Ok(Self {
            connection,
            channel,
            exchange: topology.exchange.clone(),
            timeout: DEFAULT_CALL_TIMEOUT,
        })
    }

    /// The time limit of one batch, publishes and confirms (default
    /// [`DEFAULT_CALL_TIMEOUT`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    async fn publish_all(&self, messages: &[OutgoingMessage]) -> Result<Vec<Verdict>, BrokerError> {
        let publish = |e| BrokerError::broker(BROKER, "publish", e);
        // All publishes first, then all confirms: one round trip per batch, not per message,
        // and one channel keeps their order.
        let mut confirms = Vec::with_capacity(messages.len());
        for message in messages {
            let properties = BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id(ShortString::from(message.id.as_str()))
                .with_content_type("application/json".into());
            let confirm = self
                .channel
                .basic_publish(
                    &self.exchange,
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
}

#[async_trait]
impl Publisher for AmqpPublisher {
    async fn publish_confirmed(
        &self,
        messages: &[OutgoingMessage],
    ) -> Result<Vec<Verdict>, BrokerError> {
        deadline(BROKER, "publish", self.timeout, self.publish_all(messages)).await
    }

    async fn close(&self) {
        let _ =
            tokio::time::timeout(self.timeout, self.connection.close(200, "relay stopped")).await;
    }
}

/// Consumes the topology's queue with manual acks.
pub struct AmqpSubscriber {
    connection: Connection,
    consumer: lapin::Consumer,
    timeout: Duration,
}

impl AmqpSubscriber {
    /// Connects, declares `topology` and starts consuming its queue with at most `prefetch`
    /// unacknowledged deliveries at once.
    pub async fn connect(
        url: &str,
        topology: &AmqpTopology,
        prefetch: u16,
    ) -> Result<Self, BrokerError> {
        let (connection, channel) = topology.open(url).await?;
        channel
            .basic_qos(prefetch.max(1), BasicQosOptions::default())
            .await
            .map_err(|e| BrokerError::broker(BROKER, "set the prefetch", e))?;
        let consumer = channel
            .basic_consume(
                &topology.queue,
                "",
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| BrokerError::broker(BROKER, "consume", e))?;
        Ok(Self {
            connection,
            consumer,
            timeout: DEFAULT_CALL_TIMEOUT,
        })
    }
}

#[async_trait]
impl Subscriber for AmqpSubscriber {
    type Delivery = AmqpDelivery;

    async fn next(&mut self) -> Result<AmqpDelivery, BrokerError> {
        match self.consumer.next().await {
            Some(Ok(delivery)) => Ok(AmqpDelivery {
                delivery,
                timeout: self.timeout,
            }),
            Some(Err(e)) => Err(BrokerError::broker(BROKER, "receive", e)),
            None => Err(BrokerError::Closed { broker: BROKER }),
        }
    }

    async fn close(self) {
        // Deliveries still unacknowledged go back to the queue.
        let _ = tokio::time::timeout(self.timeout, self.connection.close(200, "consumer stopped"))
            .await;
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
