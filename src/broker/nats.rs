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
        AckKind,
    },
    HeaderMap,
};

use super::{BrokerError, Delivery, OutgoingMessage, Publisher, Subscriber};

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
        .map_err(|e| BrokerError::broker(BROKER, "declare the stream", e))
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
            .map_err(|e| BrokerError::broker(BROKER, "declare the consumer", e))
    }
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
pub struct NatsPublisher {
    js: jetstream::Context,
    route: Route,
}

impl NatsPublisher {
    /// Connects and declares the topology's stream. Messages go to the subject named by their
    /// topic unless [`route`](Self::route) says otherwise.
    pub async fn connect(url: &str, topology: &NatsTopology) -> Result<Self, BrokerError> {
        let js = connect(url).await?;
        topology.declare_stream(&js).await?;
        Ok(Self {
            js,
            route: Arc::new(str::to_owned),
        })
    }

    /// Maps a message topic to its subject, e.g. `payment.created` to `payments.created`.
    pub fn route(mut self, route: impl Fn(&str) -> String + Send + Sync + 'static) -> Self {
        self.route = Arc::new(route);
        self
    }
}

#[async_trait]
impl Publisher for NatsPublisher {
    async fn publish_confirmed(&self, messages: &[OutgoingMessage]) -> Result<(), BrokerError> {
        let publish = |e| BrokerError::broker(BROKER, "publish", e);
        let mut acks = Vec::with_capacity(messages.len());
        for message in messages {
            let mut headers = HeaderMap::new();
            headers.insert(NATS_MESSAGE_ID, message.id.as_str());
            let ack = self
                .js
                .publish_with_headers(
                    (self.route)(&message.topic),
                    headers,
                    Bytes::copy_from_slice(&message.payload),
                )
                .await
                .map_err(publish)?;
            acks.push(ack);
        }
        for ack in acks {
            // A duplicate (`duplicate: true`) is acknowledged too: the stream has it already.
            ack.await.map_err(publish)?;
        }
        Ok(())
    }
}

/// Pulls from the topology's durable consumer.
pub struct NatsSubscriber {
    messages: pull::Stream,
}

impl NatsSubscriber {
    /// Connects, declares the topology and starts pulling at most `batch` messages at a time.
    pub async fn connect(
        url: &str,
        topology: &NatsTopology,
        batch: usize,
    ) -> Result<Self, BrokerError> {
        let js = connect(url).await?;
        let consumer = topology.declare(&js).await?;
        let messages = consumer
            .stream()
            .max_messages_per_batch(batch.max(1))
            .messages()
            .await
            .map_err(|e| BrokerError::broker(BROKER, "pull", e))?;
        Ok(Self { messages })
    }
}

#[async_trait]
impl Subscriber for NatsSubscriber {
    type Delivery = NatsDelivery;

    async fn next(&mut self) -> Result<NatsDelivery, BrokerError> {
        loop {
            match self.messages.next().await {
                Some(Ok(message)) => return Ok(NatsDelivery(message)),
                // Missed heartbeats and the like: the stream recovers by itself.
                Some(Err(error)) => {
                    tracing::warn!(%error, "nats: pulling messages failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                None => return Err(BrokerError::Closed { broker: BROKER }),
            }
        }
    }
}

/// A JetStream delivery.
pub struct NatsDelivery(jetstream::Message);

impl NatsDelivery {
    async fn settle(&self, kind: AckKind, action: &'static str) -> Result<(), BrokerError> {
        self.0
            .ack_with(kind)
            .await
            .map_err(|e| BrokerError::broker(BROKER, action, e))
    }
}

#[async_trait]
impl Delivery for NatsDelivery {
    fn message_id(&self) -> Option<&str> {
        self.0
            .headers
            .as_ref()
            .and_then(|headers| headers.get(NATS_MESSAGE_ID))
            .map(|id| id.as_str())
    }

    fn payload(&self) -> &[u8] {
        &self.0.payload
    }

    fn attempt(&self) -> u32 {
        self.0
            .info()
            .ok()
            .and_then(|info| u32::try_from(info.delivered).ok())
            .unwrap_or(1)
    }

    async fn ack(&self) -> Result<(), BrokerError> {
        // Waits for the server to confirm the ack, so an ack lost on the way shows up here.
        self.0
            .double_ack()
            .await
            .map_err(|e| BrokerError::broker(BROKER, "ack", e))
    }

    async fn retry(&self, delay: Duration) -> Result<(), BrokerError> {
        self.settle(AckKind::Nak(Some(delay)), "nak").await
    }

    async fn dead_letter(&self) -> Result<(), BrokerError> {
        self.settle(AckKind::Term, "term").await
    }
}
