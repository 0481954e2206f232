//! NATS JetStream through async-nats (feature `nats`), speaking the API of nats-server 2.9
//! (the client's `server_2_10`+ features stay off: they create consumers through an API
//! subject 2.9 does not know).
//!
//! Topology ([`NatsTopology::declare`], idempotent): a stream (e.g. `PAYMENTS` on
//! `payments.>`) and a durable pull consumer (e.g. `receipts`) with explicit acks, an ack
//! wait and a `max_deliver` bound. Publishing sets `Nats-Msg-Id` to the message id, so the
//! server drops a re-publish within the stream's duplicate window (2 minutes by default), and
//! waits for the publish ack. A dead letter is a `term`: the server stops redelivering it.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;

use async_nats::{
    header::NATS_MESSAGE_ID,
    jetstream::{
        self,
        consumer::{pull, AckPolicy},
        context::{
            ConsumerInfoErrorKind, CreateStreamErrorKind, GetStreamByNameErrorKind, PublishError,
            PublishErrorKind,
        },
        stream::ConsumerErrorKind,
        AckKind,
    },
    HeaderMap,
};

use super::{
    deadline, within, Backoff, BrokerError, Delivery, OutgoingMessage, Publisher, Refusal,
    Subscriber, Verdict, DEFAULT_CALL_TIMEOUT,
};

/// The client library, for what this module does not wrap (e.g. deleting a test's stream).
pub use async_nats;

const BROKER: &str = "nats";

/// The stream and its durable consumer. See the [module docs](self).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsTopology {
    /// The stream name, e.g. `PAYMENTS`.
    pub stream: String,
    /// The subjects the stream keeps, e.g. `payments.>`.
    pub subjects: Vec<String>,
    /// The durable pull consumer, e.g. `receipts`.
    pub consumer: String,
    /// How long a delivery may stay unacknowledged before the server delivers it again.
    pub ack_wait: Duration,
    /// Deliveries of one message before the server gives up on it.
    pub max_deliver: i64,
}

impl NatsTopology {
    /// Stream `stream` on `subjects`, consumer `consumer`, ack wait 30 s, 20 deliveries.
    ///
    /// The delivery bound is well above the [inbox consumer](crate::inbox::Consumer)'s
    /// `max_attempts` (which dead-letters a failing message itself) because deliveries also
    /// pile up without any failure: a handler slower than the ack wait, a consumer killed
    /// mid-message. A message the server stops delivering is lost to the consumer.
    pub fn new(
        stream: impl Into<String>,
        subjects: impl IntoIterator<Item = impl Into<String>>,
        consumer: impl Into<String>,
    ) -> Self {
        Self {
            stream: stream.into(),
            subjects: subjects.into_iter().map(Into::into).collect(),
            consumer: consumer.into(),
            ack_wait: Duration::from_secs(30),
            max_deliver: 20,
        }
    }

    /// Creates the stream if it does not exist (an existing one is used as it is).
    pub async fn declare_stream(
        &self,
        js: &jetstream::Context,
    ) -> Result<jetstream::stream::Stream, BrokerError> {
        js.get_or_create_stream(jetstream::stream::Config {
            name: self.stream.clone(),
            subjects: self.subjects.clone(),
            ..Default::default()
        })
        .await
        .map_err(|e| {
            let refused = match e.kind() {
                CreateStreamErrorKind::JetStream(answer) => refuses(&answer),
                CreateStreamErrorKind::EmptyStreamName
                | CreateStreamErrorKind::InvalidStreamName
                | CreateStreamErrorKind::DomainAndExternalSet => true,
                _ => false,
            };
            BrokerError::failed(BROKER, "declare the stream", refused, e)
        })
    }

    /// Creates the stream and the durable consumer if they do not exist.
    pub async fn declare(
        &self,
        js: &jetstream::Context,
    ) -> Result<jetstream::consumer::PullConsumer, BrokerError> {
        let stream = self.declare_stream(js).await?;
        stream
            .get_or_create_consumer(
                &self.consumer,
                pull::Config {
                    durable_name: Some(self.consumer.clone()),
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: self.ack_wait,
                    max_deliver: self.max_deliver,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| {
                let refused = match e.kind() {
                    ConsumerErrorKind::JetStream(answer) => refuses(&answer),
                    ConsumerErrorKind::InvalidName | ConsumerErrorKind::InvalidConsumerType => true,
                    _ => false,
                };
                BrokerError::failed(BROKER, "declare the consumer", refused, e)
            })
    }
}

/// Whether JetStream's answer refuses the request itself (a 4xx: a stream whose subjects
/// overlap another's, a consumer or stream whose settings the server rejects, a limit of the
/// account), rather than the server being unable to answer now (a 5xx: JetStream still
/// starting or without a leader) or the object having gone missing meanwhile (404).
fn refuses(answer: &jetstream::Error) -> bool {
    (400..500).contains(&answer.code()) && answer.code() != 404
}

/// Opens a JetStream context on a new connection.
pub async fn connect(url: &str) -> Result<jetstream::Context, BrokerError> {
    let client = async_nats::connect(url)
        .await
        .map_err(|e| BrokerError::broker(BROKER, "connect", e))?;
    Ok(jetstream::new(client))
}

type Route = Arc<dyn Fn(&str) -> String + Send + Sync>;

/// Publishes to JetStream with `Nats-Msg-Id` and waits for the publish acks.
///
/// The client reconnects by itself after a dropped connection or a server restart; a batch
/// that fails meanwhile (publish acks time out within the publisher's time limit) is an
/// error the relay retries. A stream lost with the server's store is declared again.
pub struct NatsPublisher {
    js: jetstream::Context,
    topology: NatsTopology,
    route: Route,
    timeout: Duration,
}

impl NatsPublisher {
    /// Connects and declares the topology's stream. Messages go to the subject named by their
    /// topic unless [`route`](Self::route) says otherwise.
    pub async fn connect(url: &str, topology: &NatsTopology) -> Result<Self, BrokerError> {
        let js = connect(url).await?;
        topology.declare_stream(&js).await?;
        Ok(Self {
            js,
            topology: topology.clone(),
            route: Arc::new(str::to_owned),
            timeout: DEFAULT_CALL_TIMEOUT,
        })
    }

    /// Maps a message topic to its subject, e.g. `payment.created` to `payments.created`.
    pub fn route(mut self, route: impl Fn(&str) -> String + Send + Sync + 'static) -> Self {
        self.route = Arc::new(route);
        self
    }

    /// The time limit of one batch, publishes and acks (default [`DEFAULT_CALL_TIMEOUT`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    async fn publish_all(&self, messages: &[OutgoingMessage]) -> Result<Vec<Verdict>, BrokerError> {
        let publish = |e| BrokerError::broker(BROKER, "publish", e);
        let mut acks = Vec::with_capacity(messages.len());
        for message in messages {
            let mut headers = HeaderMap::new();
            headers.insert(NATS_MESSAGE_ID, message.id.as_str());
            let subject = (self.route)(&message.topic);
            let ack = self
                .js
                .publish_with_headers(
                    subject.clone(),
                    headers,
                    Bytes::copy_from_slice(&message.payload),
                )
                .await
                .map_err(publish)?;
            acks.push((subject, ack));
        }
        let mut verdicts = Vec::with_capacity(acks.len());
        for (subject, ack) in acks {
            // A duplicate (`duplicate: true`) is acknowledged too: the stream has it already.
            verdicts.push(match ack.await {
                Ok(_) => Ok(()),
                Err(error) => Err(self.refusal(&subject, error).await?),
            });
        }
        Ok(verdicts)
    }

    /// What a failed publish ack says about the message: a refusal when the server answered
    /// about it, a [`BrokerError`] when the broker may just be unwell.
    async fn refusal(&self, subject: &str, error: PublishError) -> Result<Refusal, BrokerError> {
        match error.kind() {
            // "No responders" is also what a JetStream that is restarting answers: the
            // message is refused only if the server says that no stream covers its subject,
            // even after the topology's stream was declared again (a server that lost its
            // store lost the stream: that is no fault of the message).
            PublishErrorKind::StreamNotFound => {
                let not_found = |found: Result<
                    String,
                    jetstream::context::GetStreamByNameError,
                >| {
                    matches!(found, Err(e) if e.kind() == GetStreamByNameErrorKind::NotFound)
                };
                if !not_found(self.js.stream_by_subject(subject).await) {
                    return Err(BrokerError::broker(BROKER, "publish", error));
                }
                self.topology.declare_stream(&self.js).await?;
                if not_found(self.js.stream_by_subject(subject).await) {
                    return Ok(Refusal::new(
                        BROKER,
                        format!("no stream covers subject {subject}"),
                    ));
                }
                tracing::warn!(stream = %self.topology.stream, "nats: the stream was missing and is declared again");
                Err(BrokerError::broker(BROKER, "publish", error))
            }
            // The stream answered with an error about this message (e.g. too large).
            PublishErrorKind::Other
                if std::error::Error::source(&error)
                    .is_some_and(|source| source.is::<jetstream::Error>()) =>
            {
                Ok(Refusal::new(BROKER, super::error_chain(&error)))
            }
            _ => Err(BrokerError::broker(BROKER, "publish", error)),
        }
    }
}

#[async_trait]
impl Publisher for NatsPublisher {
    async fn publish_confirmed(
        &self,
        messages: &[OutgoingMessage],
    ) -> Result<Vec<Verdict>, BrokerError> {
        deadline(BROKER, "publish", self.timeout, self.publish_all(messages)).await
    }
}

/// Pulls from the topology's durable consumer.
///
/// The client reconnects by itself; when pulling fails (a missed heartbeat, a server restart,
/// a consumer lost with the server's store) [`next`](Subscriber::next) declares the stream and
/// the consumer again and pulls anew, after a jittered [`Backoff`]. A consumer deleted on a
/// running server is found by the [idle check](Self::idle_check) and declared again. A
/// declaration the server refuses (a stream whose subjects overlap another's, settings it
/// rejects) is returned as [`BrokerError::Misconfigured`]: retrying cannot cure it, and an
/// inbox consumer stops with it.
pub struct NatsSubscriber {
    js: jetstream::Context,
    topology: NatsTopology,
    batch: usize,
    messages: Option<pull::Stream>,
    backoff: Backoff,
    timeout: Duration,
    idle_check: Duration,
}

/// How long a subscriber waits for a delivery before it asks the server whether its consumer
/// still exists (see [`NatsSubscriber::idle_check`]).
pub const DEFAULT_IDLE_CHECK: Duration = Duration::from_secs(30);

impl NatsSubscriber {
    /// Connects, declares the topology and starts pulling at most `batch` messages at a time;
    /// fails if the server cannot be reached now.
    pub async fn connect(
        url: &str,
        topology: &NatsTopology,
        batch: usize,
    ) -> Result<Self, BrokerError> {
        let js = connect(url).await?;
        let mut subscriber = Self {
            js,
            topology: topology.clone(),
            batch: batch.max(1),
            messages: None,
            backoff: Backoff::default(),
            timeout: DEFAULT_CALL_TIMEOUT,
            idle_check: DEFAULT_IDLE_CHECK,
        };
        subscriber.messages = Some(subscriber.pull().await?);
        Ok(subscriber)
    }

    /// The backoff between two tries to pull again (default [`Backoff::default`]: 100 ms
    /// doubling up to 5 s).
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// After this long without a delivery (default [`DEFAULT_IDLE_CHECK`]), the subscriber
    /// asks the server whether its stream and consumer still exist, and declares them again
    /// (or returns the server's refusal) if not. A pull on a consumer that was deleted on a
    /// running server (by an operator, or with its stream) neither fails nor delivers: without
    /// this check the subscriber would wait forever.
    pub fn idle_check(mut self, after: Duration) -> Self {
        self.idle_check = after.max(Duration::from_millis(1));
        self
    }

    /// Whether the server says the consumer (or its stream) is gone; `false` when it cannot
    /// tell now (the pull's own errors cover an unreachable server).
    async fn consumer_lost(&self) -> bool {
        let ask = async {
            let stream = self
                .js
                .get_stream_no_info(&self.topology.stream)
                .await
                .ok()?;
            match stream.consumer_info(&self.topology.consumer).await {
                Err(e) => Some(matches!(
                    e.kind(),
                    ConsumerInfoErrorKind::NotFound | ConsumerInfoErrorKind::StreamNotFound
                )),
                Ok(_) => Some(false),
            }
        };
        tokio::time::timeout(self.timeout, ask)
            .await
            .ok()
            .flatten()
            .unwrap_or(false)
    }

    async fn pull(&self) -> Result<pull::Stream, BrokerError> {
        let pull = async {
            let consumer = self.topology.declare(&self.js).await?;
            consumer
                .stream()
                .max_messages_per_batch(self.batch)
                .messages()
                .await
                .map_err(|e| BrokerError::broker(BROKER, "pull", e))
        };
        deadline(BROKER, "pull", self.timeout, pull).await
    }
}

#[async_trait]
impl Subscriber for NatsSubscriber {
    type Delivery = NatsDelivery;

    async fn next(&mut self) -> Result<NatsDelivery, BrokerError> {
        loop {
            let Some(messages) = &mut self.messages else {
                match self.pull().await {
                    Ok(messages) => self.messages = Some(messages),
                    Err(error) if error.is_permanent() => return Err(error),
                    Err(error) => {
                        tracing::warn!(error = %super::error_chain(&error), "nats: pulling again failed; trying again");
                        self.backoff.wait().await;
                    }
                }
                continue;
            };
            let Ok(next) = tokio::time::timeout(self.idle_check, messages.next()).await else {
                if self.consumer_lost().await {
                    tracing::warn!(consumer = %self.topology.consumer, "nats: the consumer is gone from the server; declaring it again");
                    self.messages = None;
                }
                continue;
            };
            let error = match next {
                Some(Ok(message)) => {
                    self.backoff.reset();
                    return Ok(NatsDelivery {
                        message,
                        ack_wait: self.topology.ack_wait,
                        timeout: self.timeout,
                    });
                }
                Some(Err(error)) => error.to_string(),
                None => "the pull stream ended".to_owned(),
            };
            tracing::warn!(%error, consumer = %self.topology.consumer, "nats: pulling messages failed; pulling again");
            self.messages = None;
            self.backoff.wait().await;
        }
    }
}

/// A JetStream delivery.
pub struct NatsDelivery {
    message: jetstream::Message,
    ack_wait: Duration,
    timeout: Duration,
}

impl NatsDelivery {
    async fn settle(&self, kind: AckKind, action: &'static str) -> Result<(), BrokerError> {
        within(BROKER, action, self.timeout, self.message.ack_with(kind)).await
    }
}

#[async_trait]
impl Delivery for NatsDelivery {
    fn message_id(&self) -> Option<&str> {
        self.message
            .headers
            .as_ref()
            .and_then(|headers| headers.get(NATS_MESSAGE_ID))
            .map(|id| id.as_str())
    }

    fn payload(&self) -> &[u8] {
        &self.message.payload
    }

    fn delivery_count(&self) -> u32 {
        self.message
            .info()
            .ok()
            .and_then(|info| u32::try_from(info.delivered).ok())
            .unwrap_or(1)
    }

    async fn ack(&self) -> Result<(), BrokerError> {
        // Waits for the server to confirm the ack, so an ack lost on the way shows up here.
        within(BROKER, "ack", self.timeout, self.message.double_ack()).await
    }

    async fn retry(&self, delay: Duration) -> Result<(), BrokerError> {
        self.settle(AckKind::Nak(Some(delay)), "nak").await
    }

    async fn dead_letter(&self, _reason: &str) -> Result<(), BrokerError> {
        // nats-server 2.9 has no term reason; the consumer's log line keeps it.
        self.settle(AckKind::Term, "term").await
    }

    fn keep_alive_every(&self) -> Option<Duration> {
        // A third of the ack wait: two keep-alives may be late before the lease runs out.
        Some(self.ack_wait / 3)
    }

    async fn keep_alive(&self) -> Result<(), BrokerError> {
        self.settle(AckKind::Progress, "extend the ack wait").await
    }
}
