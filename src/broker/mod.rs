//! Message brokers for the outbox relay (module `outbox`) and inbox consumers (module `inbox`):
//! a small [`Publisher`] / [`Subscriber`] pair, so that a broker is one file behind its cargo
//! feature and Kafka or SQS can follow.
//!
//! | feature | broker | publishing | consuming |
//! |---|---|---|---|
//! | `amqp` | RabbitMQ (module `amqp`) | persistent messages, `message_id`, publisher confirms | quorum queue, manual acks, prefetch, delivery limit, dead-letter queue |
//! | `nats` | NATS JetStream (module `nats`) | `Nats-Msg-Id` (server-side dedup), publish acks | durable pull consumer, explicit acks, ack wait, `max_deliver`, term |
//!
//! Both are at-least-once: a message may arrive twice, and two copies may be in flight at
//! once. The inbox turns that into exactly one effect in your database.

use std::time::Duration;

use async_trait::async_trait;

use crate::BoxError;

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(feature = "nats")]
pub mod nats;

/// One message to publish: an outbox row on its way to the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutgoingMessage {
    /// The message id the consumers deduplicate on (RabbitMQ `message_id`, NATS
    /// `Nats-Msg-Id`): the outbox event id.
    pub id: String,
    /// What the message is about, e.g. `payment.created`: the routing key on RabbitMQ; NATS
    /// maps it to a subject.
    pub topic: String,
    /// The body (JSON by convention).
    pub payload: Vec<u8>,
}

/// Publishes messages and waits until the broker has taken responsibility for them.
#[async_trait]
pub trait Publisher: Send + Sync + 'static {
    /// Publishes `messages` in order and returns once the broker confirmed every one of them
    /// (stored durably). On an error some of them may have been published anyway: the caller
    /// keeps them unsent and publishes them again (consumers deduplicate by id).
    async fn publish_confirmed(&self, messages: &[OutgoingMessage]) -> Result<(), BrokerError>;

    /// Closes the connection politely (a relay calls it when it stops). Default: nothing.
    async fn close(&self) {}
}

#[async_trait]
impl<P: Publisher + ?Sized> Publisher for Box<P> {
    async fn publish_confirmed(&self, messages: &[OutgoingMessage]) -> Result<(), BrokerError> {
        (**self).publish_confirmed(messages).await
    }

    async fn close(&self) {
        (**self).close().await
    }
}

#[async_trait]
impl<P: Publisher + ?Sized> Publisher for std::sync::Arc<P> {
    async fn publish_confirmed(&self, messages: &[OutgoingMessage]) -> Result<(), BrokerError> {
        (**self).publish_confirmed(messages).await
    }

    async fn close(&self) {
        (**self).close().await
    }
}

/// A stream of deliveries from one durable queue or consumer.
#[async_trait]
pub trait Subscriber: Send + 'static {
    /// What [`next`](Self::next) hands out.
    type Delivery: Delivery;

    /// The next delivery; waits until one arrives. An error means the connection is gone:
    /// unacknowledged deliveries go back to the broker by themselves.
    async fn next(&mut self) -> Result<Self::Delivery, BrokerError>;

    /// Closes the connection politely once every delivery is settled (a consumer calls it
    /// when it stops). Default: nothing.
    async fn close(self)
    where
        Self: Sized,
    {
    }
}

/// One delivered copy of a message. Exactly one of [`ack`](Self::ack),
/// [`retry`](Self::retry) or [`dead_letter`](Self::dead_letter) settles it; a delivery that is
/// never settled (the process died) is delivered again by the broker.
#[async_trait]
pub trait Delivery: Send + Sync + 'static {
    /// The message id set by the publisher, if any.
    fn message_id(&self) -> Option<&str>;
    /// The body.
    fn payload(&self) -> &[u8];
    /// Which delivery of this message this is, counting from 1, when the broker tells.
    fn attempt(&self) -> u32;
    /// Done: the broker forgets the message.
    async fn ack(&self) -> Result<(), BrokerError>;
    /// Not now: deliver it again later (after `delay` where the broker supports it).
    async fn retry(&self, delay: Duration) -> Result<(), BrokerError>;
    /// Never: move it to the dead-letter route (RabbitMQ) or stop its redelivery (NATS term).
    async fn dead_letter(&self) -> Result<(), BrokerError>;
}

/// Why a broker operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// The broker failed or could not be reached; the source is the client library's error.
    #[error(
        "{broker}: could not {action}; check that the broker is reachable at the configured URL"
    )]
    Broker {
        /// `"amqp"` or `"nats"`.
        broker: &'static str,
        /// What was being done (`"connect"`, `"publish"`, `"declare the topology"`, ...).
        action: &'static str,
        /// The client library's error.
        #[source]
        source: BoxError,
    },
    /// The broker refused a message (a publisher nack, or no queue bound to its routing key).
    #[error("{broker} refused message {message_id}: {reason}")]
    Refused {
        /// `"amqp"` or `"nats"`.
        broker: &'static str,
        /// The refused message's id.
        message_id: String,
        /// What the broker said.
        reason: String,
    },
    /// The subscription ended (the connection or channel closed).
    #[error("{broker}: the subscription ended; reconnect")]
    Closed {
        /// `"amqp"` or `"nats"`.
        broker: &'static str,
    },
}

impl BrokerError {
    #[allow(dead_code)] // used by the broker modules, each behind its feature
    pub(crate) fn broker(
        broker: &'static str,
        action: &'static str,
        source: impl Into<BoxError>,
    ) -> Self {
        BrokerError::Broker {
            broker,
            action,
            source: source.into(),
        }
    }
}

/// An error with its sources, for one log line.
#[cfg(feature = "sqlx")] // the relay and the consumer log with it
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
