//! The transactional outbox (producer side): write an event in the same transaction as the
//! business change, and let a [`Relay`] publish it after the commit.
//!
//! ```text
//! your transaction:  INSERT charge ... ; outbox.enqueue(&mut tx, event) ; COMMIT
//! relay (any number): take due rows (FOR UPDATE SKIP LOCKED) -> publish -> broker's verdicts
//!                     -> mark accepted rows sent, count refused rows' attempts -> COMMIT
//! ```
//!
//! A rolled-back transaction publishes nothing; a committed one is published at least once,
//! whatever crashes: a relay that dies between the broker's confirmation and its own commit
//! leaves the rows unsent, and they are published again (consumers deduplicate by the event
//! id with the [inbox](crate::inbox); NATS also drops a re-publish within its duplicate
//! window).
//!
//! # Rows the broker refuses: parking
//!
//! The broker answers for each message of a batch. A row it refuses (a RabbitMQ `mandatory`
//! return: no queue is bound to its topic; a publisher nack; a NATS subject no stream covers)
//! does not fail its batch: the other rows are marked sent, and the refused row gets its own
//! attempt count, its error (`last_error`) and a next attempt after a backoff that doubles
//! up to a ceiling. At its last attempt ([`RefusalPolicy::max_attempts`], 10 by default,
//! about 4 minutes) it is *parked*: it stays in the table with its error and attempts, is
//! never taken again, and the relay logs one warning and counts it
//! (`idempotency_outbox_refused_total{outcome="parked"}`, see the `metrics` module).
//!
//! An operator finds parked rows with [`SqlOutbox::parked`] and [`SqlOutbox::parked_count`]
//! (or `SELECT .. WHERE parked_at IS NOT NULL AND sent_at IS NULL`), fixes the cause (binds
//! the queue, creates the stream), and puts them back in line with
//! [`SqlOutbox::requeue_parked`] (one event id) or [`SqlOutbox::requeue_all_parked`]: each
//! starts over with a full budget of attempts and is due at once. A parked row is kept until
//! it is re-queued and sent, or deleted by hand: the purge deletes sent rows only.
//!
//! # What a broker outage costs
//!
//! Only a verdict about a row spends its attempts. A batch that fails as a whole (the broker
//! down or unreachable, a connection lost, a publish that outlives
//! [`publish_timeout`](SqlOutbox::publish_timeout)) records nothing: its rows stay due, and
//! the relay tries again after [`retry_delay`](RelayConfig::retry_delay), doubling with
//! jitter up to [`retry_ceiling`](RelayConfig::retry_ceiling) (30 s). An outage of any length
//! parks no row and loses none; it costs latency (the events committed meanwhile leave
//! within one retry wait of the broker's return), and a batch cut off after the broker took
//! some of it is published again (the consumers' inbox drops the copies).
//!
//! # Ordering
//!
//! One relay publishes rows in the order of their sequence number (insertion order), batch
//! after batch, on one channel; so events of one aggregate whose transactions were serialized
//! (they lock the aggregate's row) reach the broker in order, and RabbitMQ delivers one queue
//! in order to a single consumer. Several relays, retries after a failed publish, several
//! consumers or a prefetch above one each allow reordering: if a consumer needs per-aggregate
//! order, run one relay and make the handler check the aggregate's version.
//!
//! A refused row does not hold back the rows after it, **including the later rows of its own
//! ordering key**: while it waits for its next attempt, and once it is parked, the events
//! enqueued after it for the same aggregate are sent before it. When it is finally sent (a
//! retry that the broker takes, or a re-queue), it arrives after them. A consumer that needs
//! per-key order must tell a late event by the aggregate's version, as above; the outbox
//! chooses progress for every other event over holding a key's events behind one the broker
//! may never take.
//!
//! # Sent rows
//!
//! A relay purges rows sent more than [`sent_retention`](RelayConfig::sent_retention) ago
//! every [`purge_every`](RelayConfig::purge_every), in bounded batches, even while every batch
//! it takes is full: the table holds the backlog, parked rows, and about one retention's
//! worth of sent rows.
//!
//! # Backends
//!
//! | backend | rows taken with | while the broker confirms | wake-up |
//! |---|---|---|---|
//! | PostgreSQL (`PgOutbox`) | `FOR UPDATE SKIP LOCKED`: relays share the work | the batch's rows stay locked (at most `publish_timeout`) | `LISTEN/NOTIFY` on commit, polling as fallback |
//! | MySQL 8 / MariaDB 10.6+ (`MySqlOutbox`) | `FOR UPDATE SKIP LOCKED` | the batch's rows stay locked | polling |
//! | SQLite (`SqliteOutbox`) | a lease written in one short `BEGIN IMMEDIATE` transaction | no lock held: producers write meanwhile; a lease ends after twice `publish_timeout` | polling |

use async_trait::async_trait;
use std::{sync::Arc, time::Duration};
use tokio::sync::Notify;

use crate::broker::{BrokerError, OutgoingMessage, Publisher};
use crate::sql::InvalidIdentifier;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
mod refusals;
mod relay;
mod sql_outbox;
#[cfg(feature = "sqlite")]
mod sqlite;

#[cfg(feature = "mysql")]
pub use mysql::MySqlOutbox;
#[cfg(feature = "postgres")]
pub use postgres::PgOutbox;
pub use refusals::{ParkedRow, RefusalPolicy};
pub use relay::{Relay, RelayConfig};
pub use sql_outbox::{OutboxDatabase, SqlOutbox, DEFAULT_PUBLISH_TIMEOUT};
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteOutbox;

/// The default outbox table.
pub const DEFAULT_TABLE: &str = "tower_outbox";

/// An event to enqueue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewEvent {
    /// The event id: the broker message id consumers deduplicate on.
    pub id: String,
    /// The topic, e.g. `payment.created` (the routing key on RabbitMQ).
    pub topic: String,
    /// The ordering key, e.g. the payment id (see [`with_key`](Self::with_key)); `None` by
    /// default.
    pub key: Option<String>,
    /// The body, JSON by convention.
    pub payload: Vec<u8>,
}

impl NewEvent {
    /// An event with a fresh random id (a UUID v4, see [`fresh_id`](Self::fresh_id)).
    pub fn new(topic: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Self::with_id(Self::fresh_id(), topic, payload)
    }

    /// An event with an id chosen by the caller, e.g. one that the payload repeats.
    pub fn with_id(
        id: impl Into<String>,
        topic: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Self {
        Self {
            id: id.into(),
            topic: topic.into(),
            key: None,
            payload: payload.into(),
        }
    }

    /// Sets the ordering key: the aggregate the event is about (e.g. the payment id). Brokers
    /// that partition by key keep the events of one key in order (the Kafka record key, the
    /// SQS FIFO `MessageGroupId`); RabbitMQ and NATS ignore it.
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// A fresh random event id.
    pub fn fresh_id() -> String {
        uuid::Uuid::new_v4().to_string()
    }
}

/// Why an outbox operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The database failed; the source is sqlx's error. Unsent rows stay unsent and are
    /// taken again by the next batch.
    #[error("the outbox table could not be read or written; check that the database is reachable and that migrate() ran")]
    Database(#[source] sqlx::Error),
    /// Publishing failed; the batch stays unsent and is published again.
    #[error("publishing the outbox batch failed; its rows stay unsent and are retried")]
    Broker(#[from] BrokerError),
    /// The table name is not a valid SQL identifier.
    #[error(transparent)]
    Config(#[from] InvalidIdentifier),
    /// The publisher answered for another number of messages than it was given (a bug in a
    /// [`Publisher`] implementation): the batch stays unsent and is retried.
    #[error("the publisher returned {verdicts} verdicts for {messages} messages; fix the Publisher implementation")]
    Verdicts {
        /// Messages in the batch.
        messages: usize,
        /// Verdicts returned.
        verdicts: usize,
    },
}

impl From<sqlx::Error> for OutboxError {
    fn from(error: sqlx::Error) -> Self {
        OutboxError::Database(error)
    }
}

/// An outbox table a [`Relay`] can drain: `PgOutbox`, `MySqlOutbox`, `SqliteOutbox`.
#[async_trait]
pub trait OutboxSource: Send + Sync + 'static {
    /// Takes up to `limit` rows that are due (not sent, not parked, past their next attempt,
    /// not held by another relay) in sequence order, publishes them, waits for the broker's
    /// verdicts and records them: accepted rows are marked sent, refused rows get an attempt
    /// counted and a later next attempt, or are parked (see [`RefusalPolicy`]). Returns how
    /// many rows it took (sent or refused); 0 when none was due. On an error nothing is
    /// recorded: the rows stay due, and no row's attempts are spent.
    async fn relay_batch(
        &self,
        publisher: &dyn Publisher,
        limit: u32,
    ) -> Result<usize, OutboxError>;

    /// Deletes at most `limit` rows sent more than `older_than` ago; returns how many.
    async fn purge_sent(&self, older_than: Duration, limit: u32) -> Result<u64, OutboxError>;

    /// How many rows wait to be sent (parked rows are not counted).
    async fn unsent(&self) -> Result<u64, OutboxError>;

    /// Starts waking `wake` whenever a transaction that enqueued events commits, where the
    /// database can tell (PostgreSQL `LISTEN`); `None` means the relay only polls.
    fn listen(&self, wake: Arc<Notify>) -> Option<tokio::task::JoinHandle<()>> {
        let _ = wake;
        None
    }
}

/// Rows a relay took, in sequence order.
struct Batch {
    seqs: Vec<i64>,
    /// The refusals each row had before this batch.
    attempts: Vec<u32>,
    messages: Vec<OutgoingMessage>,
}

/// Decodes rows `seq, id, topic, payload, ordering_key, attempts`, sorted by `seq` (a
/// statement's `RETURNING` promises no order).
fn decode_batch<R>(rows: Vec<R>) -> Result<Batch, sqlx::Error>
where
    R: sqlx::Row,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database>,
    for<'c> &'c str: sqlx::ColumnIndex<R>,
{
    let mut taken = Vec::with_capacity(rows.len());
    for row in rows {
        let seq: i64 = row.try_get("seq")?;
        let attempts: i64 = row.try_get("attempts")?;
        let message = OutgoingMessage {
            id: row.try_get("id")?,
            topic: row.try_get("topic")?,
            key: row.try_get("ordering_key")?,
            payload: row.try_get("payload")?,
        };
        taken.push((seq, u32::try_from(attempts).unwrap_or(u32::MAX), message));
    }
    taken.sort_unstable_by_key(|(seq, _, _)| *seq);
    let mut batch = Batch {
        seqs: Vec::with_capacity(taken.len()),
        attempts: Vec::with_capacity(taken.len()),
        messages: Vec::with_capacity(taken.len()),
    };
    for (seq, attempts, message) in taken {
        batch.seqs.push(seq);
        batch.attempts.push(attempts);
        batch.messages.push(message);
    }
    Ok(batch)
}

/// `<prefix>(?, ?, ...)` with one placeholder per row, for the dialects without arrays.
fn with_placeholders(prefix: &str, n: usize) -> String {
    format!("{prefix}({})", vec!["?"; n].join(", "))
}

/// Converts a count from the database, which never is negative.
fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or_default()
}
