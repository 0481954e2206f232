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
//!
//! # The pipeline end to end
//!
//! A broker redelivers (ack wait, consumer restart, rebalance, deploy), and the copies overlap.
//! The `outbox` and `inbox` modules (PostgreSQL, MySQL / MariaDB, SQLite) and the brokers behind `amqp`
//! (RabbitMQ, lapin) and `nats` (NATS JetStream, async-nats, nats-server 2.9 API) give
//! exactly-once *effects* on an at-least-once broker:
//!
//! | step | what happens | guarantee |
//! |---|---|---|
//! | producer | `PgOutbox::enqueue(&mut tx, event)` in the same transaction as the business write | the event exists iff the transaction commits |
//! | relay (`outbox::Relay`, any number) | takes unsent rows (`FOR UPDATE SKIP LOCKED`), publishes, waits for publisher confirms / publish acks, marks sent, commits; woken by `LISTEN/NOTIFY`, polls as fallback; purges sent rows in bounded batches; on shutdown sends what was committed until then, for at most `RelayConfig::shutdown_drain` (5 s) | at-least-once: a crash between confirm and commit publishes again (NATS drops it by `Nats-Msg-Id`) |
//! | broker | RabbitMQ quorum queue / JetStream durable pull consumer | at-least-once, copies may overlap |
//! | consumer (`inbox::Consumer`) | claims `(consumer, message_id)` in the handler's transaction; a copy still in flight answers "busy" at once (short `lock_timeout`, SQLSTATE 55P03) and looks again without holding a connection; acks after commit | **exactly-once effect in the database** |
//! | effects outside that database (email, HTTP calls) | run by the handler | at-least-once: make them idempotent themselves |
//! | poison (not JSON, no id, rejected by the handler) / failing handler | dead-lettered at once / after `max_attempts` (RabbitMQ: `<queue>.dead`; NATS: term), one error log line | never retried forever |
//!
//! Ordering: one relay publishes in insertion order, so events of one aggregate written by
//! serialized transactions reach the broker in order; several relays, retries and several
//! consumers may reorder. Message ids are kept `retention` (default 7 days); a copy redelivered
//! after that would run again.
//!
//! What the inbox costs: one indexed `INSERT` and one round trip in the handler's transaction.
//! For a handler that is itself one `INSERT`, that is a sixth to a quarter of consumer throughput on
//! 2 cores, and about as much as PostgreSQL alone pays for the same two transactions under
//! pgbench (the repository's BENCHMARKS.md, "Message pipeline"): the row is the cost, and
//! a handler that does more pays a smaller share of it.
//!
//! The whole pipeline runs as processes. The `payments` example is the producer: with `AMQP_URL` or `NATS_URL` (and a SQL `DATABASE_URL`) every new payment also
//! writes a `payment.created` event to the outbox in the transaction of its charge (in the
//! transactional mode, the transaction that also stores the response), and the process relays
//! the outbox itself unless `OUTBOX_RELAY=0`:
//!
//! ```sh
//! DATABASE_URL=postgres://root@127.0.0.1/test AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f \
//!     cargo run --example payments          # relays too; OUTBOX_RELAY=0 leaves it to outbox_relay
//! DATABASE_URL=postgres://root@127.0.0.1/test AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f \
//!     cargo run --example outbox_relay      # optional: more relays
//! DATABASE_URL=postgres://root@127.0.0.1/test AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f \
//!     cargo run --example receipts          # or NATS_URL=nats://127.0.0.1:4222 for all three
//! ```
//!
//! `tests/payments_pipeline.rs` SIGKILLs and restarts the payments process, a relay and two
//! consumers while clients create 40 payments (each key sent twice, half of them concurrently,
//! retried until a 201), on RabbitMQ and on NATS: one payment, one charge, one event and one
//! receipt per key, no unsent row. A 503, a 422 or a transaction killed before its commit leaves
//! no event.
//!
//! All three take `PIPELINE_NAMESPACE` (a suffix for every broker name, so tests sharing a broker stay
//! apart); `receipts` takes `RECEIPTS_DELAY_MS`, `RECEIPTS_CONCURRENCY`, `RECEIPTS_ACK_WAIT_MS`,
//! `INBOX_RETENTION_SECS`; `outbox_relay` takes `OUTBOX_POLL_MS` (so does the relay in
//! `payments`) and `OUTBOX_CONFIRM_DELAY_MS`
//! (its crash window, for tests). MySQL / MariaDB relays take rows with `SKIP LOCKED` and poll;
//! SQLite relays take turns (`BEGIN IMMEDIATE`, one writer) and poll.

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
