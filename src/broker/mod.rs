//! Message brokers for the outbox relay (module `outbox`) and inbox consumers (module `inbox`):
//! a small [`Publisher`] / [`Subscriber`] pair, so that a broker is one file behind its cargo
//! feature.
//!
//! | feature | broker | publishing | consuming |
//! |---|---|---|---|
//! | `amqp` | RabbitMQ (module `amqp`) | persistent messages, `message_id`, publisher confirms | quorum queue, manual acks, prefetch, delivery limit, dead-letter queue |
//! | `nats` | NATS JetStream (module `nats`) | `Nats-Msg-Id` (server-side dedup), publish acks | durable pull consumer, explicit acks, ack wait, `max_deliver`, term |
//! | `kafka` | Kafka (module `kafka`, rdkafka) | idempotent producer, `acks=all`, id header, ordering key as record key, delivery reports | consumer group, only the contiguous prefix of settled offsets committed, local retry, dead-letter topic |
//! | `sqs` | Amazon SQS (module `sqs`, aws-sdk-sqs) | `SendMessageBatch`, per-entry verdicts; FIFO: group = ordering key, deduplication id = message id | long polling, delete after commit, visibility heartbeat, dead-letter queue |
//!
//! All are at-least-once: a message may arrive twice, and two copies may be in flight at
//! once. The inbox turns that into exactly one effect in your database.
//!
//! What each broker's own cause of redelivery costs, with the inbox (measured by the
//! repository's tests on tansu and moto):
//!
//! | cause | what happens | cost |
//! |---|---|---|
//! | Kafka rebalance (a member joins, leaves or dies) | the partition's new owner reads again from the committed offset: messages settled but not yet committed, and those still in flight on the old owner | one more delivery each, answered "duplicate" (or "busy", then "duplicate", while the old owner's transaction runs); no loss, no second effect |
//! | Kafka handler slower than `max.poll.interval.ms` (a consumer whose concurrency is full polls no more) | the client leaves the group; its partitions go to another member, which reads from the committed offset while the handler still works | the held message: one more delivery, answered "busy" until the first commit, then "duplicate"; no second effect, and the group's offsets still end at the end of each partition |
//! | Kafka member killed mid-transaction | its transaction rolls back, its offsets past the last settled prefix were never stored | the group's session timeout, then one redelivery |
//! | SQS visibility timeout shorter than the handler, heartbeat off | a second consumer receives the message while the first works; its claim waits ("busy") for the first to commit | one more delivery, answered "duplicate"; the receive count rises |
//! | the same, heartbeat on (the default) | the visibility is extended every third of the timeout while the delivery is held | nothing: no second delivery |
//! | SQS consumer killed mid-transaction | the message becomes visible again when its visibility timeout ends | the rest of the timeout, then one redelivery |
//!
//! # The contract a broker implements
//!
//! Four brokers must fit it (RabbitMQ, NATS JetStream, Kafka, SQS), and each fault of the
//! infrastructure must cost latency, never an attempt of a message, a lost message or a second
//! effect. So:
//!
//! - **Per-message verdicts.** [`Publisher::publish_confirmed`] answers
//!   `Err(`[`BrokerError`]`)` when the broker or the connection failed (nothing is known about
//!   any message, and the relay counts nothing against its rows), and otherwise one
//!   [`Verdict`] per message, in order: `Ok(())` (the broker stored it) or a [`Refusal`] (the
//!   broker will never take *this* message: a RabbitMQ `mandatory` return or publisher nack, a
//!   NATS subject no stream covers). One refused message does not fail its neighbours, and the
//!   outbox counts refusals per row, with backoff, and parks a row past its limit. A refusal is
//!   a verdict about the message: an implementation that cannot tell a refusal from a broker
//!   that is down answers `Err`, never a [`Refusal`].
//! - **Every call has a deadline.** Connecting, publishing, waiting for confirms and settling
//!   a delivery each end within their time limit ([`BrokerError::TimedOut`]); a broker that
//!   hangs without closing the connection is a failure like any other.
//! - **An ordering key.** [`OutgoingMessage::key`] (the aggregate id, e.g. the payment id) is
//!   the Kafka record key and the SQS FIFO `MessageGroupId`: messages of one key keep their
//!   order where the broker partitions by key. RabbitMQ and NATS ignore it.
//! - **Subscribers own their session.** [`Subscriber::next`] reconnects by itself, with
//!   jittered [`Backoff`] under a ceiling, and returns `Err` only when it can never work again
//!   ([`BrokerError::is_permanent`]: closed, or a configuration the broker refuses for good).
//!   A delivery of a session that died fails to settle, harmlessly: the broker delivers the
//!   message again, and the inbox answers "duplicate" if it was handled.
//! - **Settling.** A [`Delivery`] is settled by [`ack`](Delivery::ack),
//!   [`retry`](Delivery::retry) (give it back for a later delivery: the handler failed) or
//!   [`dead_letter`](Delivery::dead_letter); a delivery held longer than the broker's lease is
//!   kept by [`keep_alive`](Delivery::keep_alive) every
//!   [`keep_alive_every`](Delivery::keep_alive_every) (NATS `+WPI`, SQS
//!   `ChangeMessageVisibility`; RabbitMQ and Kafka have no lease). A broker that cannot
//!   redeliver one message (Kafka) retries locally: the subscriber hands the message out again
//!   after the delay and does not commit past it; Kafka commits, per partition, the
//!   contiguous prefix of settled offsets.
//! - **Only the handler spends attempts.** The broker's delivery count
//!   ([`Delivery::delivery_count`]) also rises when a connection drops or a consumer dies, so
//!   it is no budget: the inbox consumer (`inbox::Consumer`, with a SQL feature) counts handler failures in
//!   its database and dead-letters on that count. The brokers' own limits (RabbitMQ
//!   `x-delivery-limit`, NATS `max_deliver`, SQS `maxReceiveCount`) are a high backstop only,
//!   against a message that kills its consumer every time.
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
//! | poison (not JSON, no id, rejected by the handler) / failing handler | dead-lettered at once / after `max_attempts` handler failures, counted in the inbox's own table (RabbitMQ: `<queue>.dead`; NATS: term), one error log line | never retried forever |
//!
//! # What a fault costs
//!
//! Every fault below costs latency, never a lost message or a second effect, and no process
//! has to be restarted:
//!
//! | fault | what happens | cost |
//! |---|---|---|
//! | broker restart, every connection dropped, a missed heartbeat (RabbitMQ asks for 10 s unless the URL sets `heartbeat`), a channel or consumer closed | a publisher drops its session and the relay's next batch opens a new one; a subscriber opens a new session (NATS: pulls again) by itself, after a jittered backoff (100 ms doubling to 5 s); the deliveries of the lost session go back to the queue; a NATS server that lost its store gets the stream and the consumer declared again | the outage plus at most one backoff step; the rows of failed batches stay unsent (no row attempt spent) and go out again, and a copy the broker had already taken is a duplicate the inbox acks |
//! | a broker that hangs without closing the connection | every call ends at its time limit ([`DEFAULT_CALL_TIMEOUT`], 10 s), and the session is dropped as above | the time limit, then as above |
//! | a message the broker refuses (no queue bound, no stream covers it) | the outbox counts the refusal on that row, backs off, and parks the row past its limit | that row waits or is parked; the rows after it flow |
//! | the consumers' database out of reach (failover, network, restart), a pool timeout, a failed `BEGIN` or `COMMIT` | the delivery is held and tried again with jittered backoff (`ConsumerConfig::outage_patience`, 60 s, then given back uncounted); held deliveries fill the consumer's concurrency, so no new ones are taken; a commit whose outcome is unknown is settled by the next try's claim (a duplicate, or it runs) | the outage plus at most one backoff step (5 s); no attempt spent, nothing dead-lettered |
//! | a consumer killed | its deliveries go back (RabbitMQ at once, NATS after the ack wait); its transaction rolls back with the claim | up to the ack wait |
//! | NATS: the consumer deleted on a running server (by hand, or with its stream) | the subscriber's idle check (30 s without a delivery) finds it gone and declares it again | up to the idle check |
//! | the broker refuses the topology itself (RabbitMQ `PRECONDITION_FAILED` / `ACCESS_REFUSED`, a JetStream 4xx such as overlapping subjects) | `BrokerError::Misconfigured`: permanent, so the subscriber returns it and the consumer stops with it instead of retrying | the consumer stops until the configuration is fixed |
//! | the database's primary killed, a standby promoted (Patroni, HAProxy in front) | the producers, relays and consumers find the new primary through their pools (the outage row above); with synchronous replication nothing committed is lost; with asynchronous replication the commits the old primary had not streamed go with it: a payment answered `201` may be gone, and an event relayed from it may still be consumed | the failover (5 to 6 s measured); synchronous replication: one standby flush per commit |
//! | two copies of a message consumed through two nodes of a MariaDB Galera cluster | both claims succeed on their nodes; the copy certified second is rolled back by the cluster (error 1213, SQLSTATE 40001: at the `COMMIT`, or at a handler statement), which is a lost race, not a handler failure: claimed again after a pause, acked as a duplicate | one pause; no attempt spent, no second effect |
//!
//! Proven against real servers in `tests/broker_reconnect.rs` (RabbitMQ behind a proxy cut
//! and silenced, a `nats-server` SIGKILLed and restarted, once on an empty store),
//! `tests/broker_misconfigured.rs` (a deleted consumer, refused topologies),
//! `tests/inbox_outage.rs` (PostgreSQL cut for 10 s under load), the pipeline fault
//! harness `tests/pipeline_faults.rs` (payments, relays and consumers as processes; on Kafka
//! and SQS: kills, and on SQS a proxy that cuts every connection), the same processes across
//! a PostgreSQL primary failover (`tests/pipeline_failover.rs`) and two consumers on two
//! Galera nodes (`tests/inbox_galera.rs`). `tests/pipeline_process.rs` kills relays and
//! consumers on all four brokers.
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
//! The whole pipeline runs as processes. The `payments` example is the producer: with one of
//! `AMQP_URL`, `NATS_URL`, `KAFKA_URL` (bootstrap servers) or `SQS_URL` (the endpoint; region
//! and credentials from the usual `AWS_*` variables, `test` / `test` on a loopback endpoint)
//! and a SQL `DATABASE_URL`, every new payment also
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
//! (or `KAFKA_URL=127.0.0.1:9092`, or `SQS_URL=http://127.0.0.1:5000`, for all three).
//!
//! `tests/payments_pipeline.rs` SIGKILLs and restarts the payments process, a relay and two
//! consumers while clients create 40 payments (each key sent twice, half of them concurrently,
//! retried until a 201), on RabbitMQ and on NATS: one payment, one charge, one event and one
//! receipt per key, no unsent row. A 503, a 422 or a transaction killed before its commit leaves
//! no event.
//!
//! All three take `PIPELINE_NAMESPACE` (a suffix for every broker name, so tests sharing a broker stay
//! apart); `receipts` takes `RECEIPTS_DELAY_MS`, `RECEIPTS_CONCURRENCY`, `RECEIPTS_ACK_WAIT_MS`,
//! `INBOX_RETENTION_SECS`, `RECEIPTS_VISIBILITY_SECS` (SQS), `KAFKA_SESSION_TIMEOUT_MS`,
//! `KAFKA_COMMIT_INTERVAL_MS`, `KAFKA_PARTITIONS`; `outbox_relay` takes `OUTBOX_POLL_MS` (so does the relay in
//! `payments`) and `OUTBOX_CONFIRM_DELAY_MS`
//! (its crash window, for tests). MySQL / MariaDB relays take rows with `SKIP LOCKED` and poll;
//! SQLite relays take turns (`BEGIN IMMEDIATE`, one writer) and poll.

use std::{future::Future, time::Duration};

use async_trait::async_trait;

use crate::BoxError;

#[cfg(feature = "amqp")]
pub mod amqp;
mod backoff;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "kafka")]
mod kafka_offsets;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "sqs")]
pub mod sqs;

pub use backoff::Backoff;

/// The time limit of one broker call when the broker's constructor is not told otherwise:
/// connecting, publishing a batch and waiting for its confirms, settling a delivery.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// One message to publish: an outbox row on its way to the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutgoingMessage {
    /// The message id the consumers deduplicate on (RabbitMQ `message_id`, NATS
    /// `Nats-Msg-Id`): the outbox event id.
    pub id: String,
    /// What the message is about, e.g. `payment.created`: the routing key on RabbitMQ; NATS
    /// maps it to a subject.
    pub topic: String,
    /// The ordering key, e.g. the payment id: messages of one key stay in order where the
    /// broker partitions by key (the Kafka record key, the SQS FIFO `MessageGroupId`).
    /// `None`: no order promised (rows written before the outbox had the column, or events
    /// enqueued without a key).
    pub key: Option<String>,
    /// The body (JSON by convention).
    pub payload: Vec<u8>,
}

/// The broker's answer for one message of a batch: `Ok(())` when it stored it.
pub type Verdict = Result<(), Refusal>;

/// The broker will not take this message (and would not take it again as it is): a RabbitMQ
/// `mandatory` return (no queue bound to its routing key) or publisher nack, a NATS subject no
/// stream covers, an SQS batch entry rejected as invalid. Never a broker that is down: that is
/// a [`BrokerError`] for the whole batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{broker} refused the message: {reason}")]
pub struct Refusal {
    /// `"amqp"`, `"nats"`, ...
    pub broker: &'static str,
    /// What the broker said, for the outbox row's `last_error` and the log.
    pub reason: String,
}

impl Refusal {
    /// A refusal by `broker` for `reason`.
    pub fn new(broker: &'static str, reason: impl Into<String>) -> Self {
        Self {
            broker,
            reason: reason.into(),
        }
    }
}

/// Publishes messages and waits until the broker has taken responsibility for them.
#[async_trait]
pub trait Publisher: Send + Sync + 'static {
    /// Publishes `messages` in order and waits for the broker's answer on each, within the
    /// publisher's time limit.
    ///
    /// - `Ok(verdicts)`: exactly one [`Verdict`] per message, in the order of `messages`.
    ///   The accepted ones are stored by the broker; the refused ones were not taken.
    /// - `Err(_)`: the broker or the connection failed, or the time limit passed: nothing is
    ///   known about any message (some may have been stored anyway). The caller keeps them all
    ///   unsent and publishes them again later (consumers deduplicate by id), without counting
    ///   this against any of them.
    async fn publish_confirmed(
        &self,
        messages: &[OutgoingMessage],
    ) -> Result<Vec<Verdict>, BrokerError>;

    /// Closes the connection politely (a relay calls it when it stops). Default: nothing.
    async fn close(&self) {}
}

#[async_trait]
impl<P: Publisher + ?Sized> Publisher for Box<P> {
    async fn publish_confirmed(
        &self,
        messages: &[OutgoingMessage],
    ) -> Result<Vec<Verdict>, BrokerError> {
        (**self).publish_confirmed(messages).await
    }

    async fn close(&self) {
        (**self).close().await
    }
}

#[async_trait]
impl<P: Publisher + ?Sized> Publisher for std::sync::Arc<P> {
    async fn publish_confirmed(
        &self,
        messages: &[OutgoingMessage],
    ) -> Result<Vec<Verdict>, BrokerError> {
        (**self).publish_confirmed(messages).await
    }

    async fn close(&self) {
        (**self).close().await
    }
}

/// A stream of deliveries from one durable queue or consumer, over a session (connection,
/// channel, pull subscription) the subscriber owns and rebuilds.
#[async_trait]
pub trait Subscriber: Send + 'static {
    /// What [`next`](Self::next) hands out.
    type Delivery: Delivery;

    /// The next delivery; waits until one arrives. When the session fails (the broker
    /// restarted, the connection dropped, a heartbeat was missed, the channel or consumer was
    /// cancelled) it reconnects by itself, with jittered backoff under a ceiling, and goes on;
    /// the deliveries of the dead session go back to the broker by themselves.
    ///
    /// An error means the subscriber can never work again ([`BrokerError::is_permanent`]):
    /// it was closed, or the broker refuses its configuration for good.
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
/// never settled (the process died, the session was lost) is delivered again by the broker.
/// Each settling call ends within the subscriber's time limit; one that fails is harmless: the
/// broker delivers the message again, and the inbox tells a duplicate.
#[async_trait]
pub trait Delivery: Send + Sync + 'static {
    /// The message id set by the publisher, if any.
    fn message_id(&self) -> Option<&str>;
    /// The body.
    fn payload(&self) -> &[u8];
    /// Which delivery of this message this is by the broker's count, from 1. It is 1 only
    /// when the broker knows this is the first delivery: a redelivery of any cause, a local
    /// retry (Kafka) included, counts more, and a broker that cannot tell says 2. The inbox
    /// reads a message's failure count from its database only when this is above 1, so a
    /// first delivery costs no extra round trip. Never a budget: it also rises when a
    /// connection drops or a consumer dies.
    fn delivery_count(&self) -> u32;
    /// Done: the broker forgets the message.
    async fn ack(&self) -> Result<(), BrokerError>;
    /// Not now: deliver it again after about `delay`. Brokers without delayed redelivery
    /// wait here first (holding only the delivery); Kafka hands it out again locally.
    async fn retry(&self, delay: Duration) -> Result<(), BrokerError>;
    /// Never: move it to the dead-letter route (RabbitMQ `<queue>.dead`, a dead-letter topic
    /// or queue) or stop its redelivery (NATS term), with `reason` where the broker can keep
    /// one.
    async fn dead_letter(&self, reason: &str) -> Result<(), BrokerError>;
    /// How often [`keep_alive`](Self::keep_alive) must be called while the delivery is held,
    /// so that the broker does not hand it to another consumer: `None` when the broker has no
    /// lease on a delivery (RabbitMQ, Kafka). Default: `None`.
    fn keep_alive_every(&self) -> Option<Duration> {
        None
    }
    /// Extends the broker's lease on the delivery (NATS `+WPI`, SQS
    /// `ChangeMessageVisibility`). Default: nothing to do.
    async fn keep_alive(&self) -> Result<(), BrokerError> {
        Ok(())
    }
}

/// Why a broker operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// The broker failed or could not be reached; the source is the client library's error.
    /// Transient: a subscriber reconnects, a relay tries again later.
    #[error(
        "{broker}: could not {action}; check that the broker is reachable at the configured URL"
    )]
    Broker {
        /// `"amqp"`, `"nats"`, ...
        broker: &'static str,
        /// What was being done (`"connect"`, `"publish"`, `"declare the topology"`, ...).
        action: &'static str,
        /// The client library's error.
        #[source]
        source: BoxError,
    },
    /// The broker did not answer within the time limit. Transient, like [`Broker`](Self::Broker).
    #[error("{broker}: could not {action} within {after:?}; the broker is slow or unreachable")]
    TimedOut {
        /// `"amqp"`, `"nats"`, ...
        broker: &'static str,
        /// What was being done.
        action: &'static str,
        /// The time limit that passed.
        after: Duration,
    },
    /// The broker refuses the configuration for good (a queue declared with other arguments,
    /// access refused, a stream that cannot be created): fix the configuration or the
    /// broker's objects. Permanent.
    #[error("{broker}: could not {action}: the broker refuses this configuration; fix it or delete the conflicting object")]
    Misconfigured {
        /// `"amqp"`, `"nats"`, ...
        broker: &'static str,
        /// What was being done.
        action: &'static str,
        /// The client library's error.
        #[source]
        source: BoxError,
    },
    /// The subscriber or publisher was closed. Permanent.
    #[error("{broker}: closed")]
    Closed {
        /// `"amqp"`, `"nats"`, ...
        broker: &'static str,
    },
}

impl BrokerError {
    /// Whether retrying can never help: the subscriber was closed, or the broker refuses the
    /// configuration. [`Subscriber::next`] returns only such errors.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            BrokerError::Misconfigured { .. } | BrokerError::Closed { .. }
        )
    }

    /// A failed call: [`Misconfigured`](Self::Misconfigured) when the broker refused the
    /// request itself (`refused`), else a transient [`Broker`](Self::Broker) error.
    #[allow(dead_code)] // used by the broker modules, each behind its feature
    pub(crate) fn failed(
        broker: &'static str,
        action: &'static str,
        refused: bool,
        source: impl Into<BoxError>,
    ) -> Self {
        if refused {
            BrokerError::Misconfigured {
                broker,
                action,
                source: source.into(),
            }
        } else {
            BrokerError::broker(broker, action, source)
        }
    }

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

/// Runs `call` (the client library's future for `action`) under the time limit `limit`.
#[allow(dead_code)] // used by the broker modules, each behind its feature
pub(crate) async fn within<T, E: Into<BoxError>>(
    broker: &'static str,
    action: &'static str,
    limit: Duration,
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, BrokerError> {
    let call = async {
        call.await
            .map_err(|e| BrokerError::broker(broker, action, e))
    };
    deadline(broker, action, limit, call).await
}

/// Runs `call`, which fails with a [`BrokerError`] already, under the time limit `limit`.
#[allow(dead_code)] // used by the broker modules, each behind its feature
pub(crate) async fn deadline<T>(
    broker: &'static str,
    action: &'static str,
    limit: Duration,
    call: impl Future<Output = Result<T, BrokerError>>,
) -> Result<T, BrokerError> {
    tokio::time::timeout(limit, call)
        .await
        .unwrap_or(Err(BrokerError::TimedOut {
            broker,
            action,
            after: limit,
        }))
}

/// An error with its sources, for one log line.
#[cfg(any(feature = "sqlx", feature = "nats", feature = "amqp", feature = "sqs"))] // the relay, the consumer, brokers' logs
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
