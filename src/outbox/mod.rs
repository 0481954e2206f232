//! The transactional outbox (producer side): write an event in the same transaction as the
//! business change, and let a [`Relay`] publish it after the commit.
//!
//! ```text
//! your transaction:  INSERT charge ... ; outbox.enqueue(&mut tx, event) ; COMMIT
//! relay (any number): take unsent rows (FOR UPDATE SKIP LOCKED) -> publish -> broker confirms
//!                     -> mark sent -> COMMIT
//! ```
//!
//! A rolled-back transaction publishes nothing; a committed one is published at least once,
//! whatever crashes: a relay that dies between the broker's confirmation and its own commit
//! leaves the rows unsent, and they are published again (consumers deduplicate by the event
//! id with the [inbox](crate::inbox); NATS also drops a re-publish within its duplicate
//! window).
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
//! # Backends
//!
//! | backend | rows taken with | wake-up |
//! |---|---|---|
//! | PostgreSQL (`PgOutbox`) | `FOR UPDATE SKIP LOCKED`: relays share the work | `LISTEN/NOTIFY` on commit, polling as fallback |
//! | MySQL 8 / MariaDB 10.6+ (`MySqlOutbox`) | `FOR UPDATE SKIP LOCKED` | polling |
//! | SQLite (`SqliteOutbox`) | `BEGIN IMMEDIATE`: one writer, so relays take turns | polling |

use async_trait::async_trait;
use std::{sync::Arc, time::Duration};
use tokio::sync::Notify;

use crate::broker::{BrokerError, OutgoingMessage, Publisher};
use crate::sql::InvalidIdentifier;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
mod relay;
mod sql_outbox;
#[cfg(feature = "sqlite")]
mod sqlite;

#[cfg(feature = "mysql")]
pub use mysql::MySqlOutbox;
#[cfg(feature = "postgres")]
pub use postgres::PgOutbox;
pub use relay::{Relay, RelayConfig};
pub use sql_outbox::{OutboxDatabase, SqlOutbox};
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
    /// In one transaction: takes up to `limit` unsent rows in sequence order (skipping rows
    /// another relay holds), publishes them, waits for the broker's confirmation, marks them
    /// sent and commits. Returns how many were sent. On any error nothing is marked sent.
    async fn relay_batch(
        &self,
        publisher: &dyn Publisher,
        limit: u32,
    ) -> Result<usize, OutboxError>;

    /// Deletes at most `limit` rows sent more than `older_than` ago; returns how many.
    async fn purge_sent(&self, older_than: Duration, limit: u32) -> Result<u64, OutboxError>;

    /// How many rows are not sent yet.
    async fn unsent(&self) -> Result<u64, OutboxError>;

    /// Starts waking `wake` whenever a transaction that enqueued events commits, where the
    /// database can tell (PostgreSQL `LISTEN`); `None` means the relay only polls.
    fn listen(&self, wake: Arc<Notify>) -> Option<tokio::task::JoinHandle<()>> {
        let _ = wake;
        None
    }
}

/// The sequence numbers and messages of rows `seq, id, topic, payload, ordering_key` taken by
/// a relay.
fn decode_batch<R>(rows: Vec<R>) -> Result<(Vec<i64>, Vec<OutgoingMessage>), sqlx::Error>
where
    R: sqlx::Row,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database>,
    for<'c> &'c str: sqlx::ColumnIndex<R>,
{
    let mut seqs = Vec::with_capacity(rows.len());
    let mut messages = Vec::with_capacity(rows.len());
    for row in rows {
        seqs.push(row.try_get("seq")?);
        messages.push(OutgoingMessage {
            id: row.try_get("id")?,
            topic: row.try_get("topic")?,
            key: row.try_get("ordering_key")?,
            payload: row.try_get("payload")?,
        });
    }
    Ok((seqs, messages))
}

/// `<prefix>(?, ?, ...)` with one placeholder per row, for the dialects without arrays.
fn with_placeholders(prefix: &str, n: usize) -> String {
    format!("{prefix}({})", vec!["?"; n].join(", "))
}

/// Converts a count from the database, which never is negative.
fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or_default()
}
