//! The inbox (consumer side): handle each message at most once per consumer name, with the
//! dedup row and the handler's writes in one transaction, and acknowledge only after commit.
//!
//! ```text
//! BEGIN
//!   INSERT INTO tower_inbox (consumer, message_id) ...   -- the claim
//!     new        -> run the handler in this transaction -> COMMIT -> ack
//!     duplicate  -> a committed copy exists -> ROLLBACK -> ack (nothing happens)
//!     busy       -> another copy holds the claim right now -> ROLLBACK, wait, look again
//! ```
//!
//! "Busy" is how two copies that overlap are kept apart without holding a pool connection:
//! on PostgreSQL the claim runs with a short `lock_timeout` (SQLSTATE 55P03), so the second
//! copy gives its connection back at once instead of waiting on the first one's row lock; on
//! MySQL / MariaDB with a short `innodb_lock_wait_timeout` (error 1205; 1 s by default, the
//! smallest MySQL allows). SQLite has one writer: the second copy waits for the lock and then
//! sees the first one's outcome. It
//! retries after a pause; when the first copy commits it sees a duplicate and acks, and when
//! the first copy dies (its transaction rolls back) it wins the claim and runs.
//!
//! Message ids are kept for a retention window (default 7 days, [`ConsumerConfig`]); a copy
//! redelivered after its id was purged would run again, so keep the window longer than any
//! redelivery (broker retention, ack wait, replays).
//!
//! Only the handler spends attempts. A handler failure ([`HandlerError::Retry`]) is counted
//! in a table beside the inbox's (`tower_inbox_failures`, one upsert per failure, read only
//! on a redelivery, purged with the ids), so the count survives redeliveries, restarts and
//! other consumers; the message is dead-lettered when it reaches
//! [`ConsumerConfig::max_attempts`]. The broker's delivery count is no budget: it also rises
//! when a connection drops. The database failing is not the handler's failure: a failed
//! `BEGIN`, claim or `COMMIT`, a pool timeout, a handler statement that could not reach the
//! server, or a failure that could not be counted holds the delivery and tries again with
//! jittered backoff ([`ConsumerConfig::outage_patience`]), and a commit whose answer was lost
//! is settled by the next try's claim: a duplicate if it committed, a fresh run if not.
//!
//! Nor is a transaction the database rolled back by itself (SQLSTATE `40001` / `40P01`, at
//! the claim, in a handler statement or at the `COMMIT`): a deadlock's victim, or on a
//! MariaDB Galera cluster a copy that lost to a copy of the same message committed through
//! another node (a certification failure or a brute-force abort, error 1213). Its claim went
//! with it, so the message is claimed again after a pause, as a busy one is: a duplicate
//! (acked) once the winner's commit is applied on this node, a fresh run if nobody won. No
//! attempt is spent, and the certification at commit keeps the two copies to one effect.
//!
//! [`Consumer`] runs the whole loop against a [`Subscriber`](crate::broker::Subscriber),
//! keeping the broker's lease on each delivery while it works
//! ([`Delivery::keep_alive`](crate::broker::Delivery::keep_alive)).

use std::time::Duration;

use async_trait::async_trait;

mod consumer;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
mod sql_inbox;
#[cfg(feature = "sqlite")]
mod sqlite;

pub use consumer::{Consumer, ConsumerConfig, Handler, HandlerError, Message, Outcome};
#[cfg(feature = "mysql")]
pub use mysql::MySqlInbox;
#[cfg(feature = "postgres")]
pub use postgres::PgInbox;
pub use sql_inbox::{InboxDatabase, SqlInbox};
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteInbox;

/// The default inbox table.
pub const DEFAULT_TABLE: &str = "tower_inbox";

/// What a claim found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboxClaim {
    /// This transaction holds the claim: run the handler, then commit.
    New,
    /// A copy of this message was handled and committed: do nothing, roll back, ack.
    Duplicate,
    /// Another copy holds the claim in a transaction still running: roll back (the
    /// transaction is aborted), wait, and try again.
    Busy,
}

/// Why an inbox operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError {
    /// The database failed; the source is sqlx's error. The message is not acknowledged,
    /// so the broker delivers it again.
    #[error("the inbox table could not be read or written; check that the database is reachable and that migrate() ran")]
    Database(#[from] sqlx::Error),
    /// The table name is not a valid SQL identifier.
    #[error(transparent)]
    Config(#[from] crate::sql::InvalidIdentifier),
}

/// An inbox table: `PgInbox`, `MySqlInbox`, `SqliteInbox`.
#[async_trait]
pub trait InboxStore: Clone + Send + Sync + 'static {
    /// The database the inbox lives in; the handler's writes go to the same transaction.
    type Database: sqlx::Database;

    /// The pool consumer transactions are taken from.
    fn pool(&self) -> &sqlx::Pool<Self::Database>;

    /// Claims `message_id` for `consumer` inside the caller's transaction. Never waits for
    /// another copy's transaction longer than a short lock timeout.
    async fn claim(
        &self,
        conn: &mut <Self::Database as sqlx::Database>::Connection,
        consumer: &str,
        message_id: &str,
    ) -> Result<InboxClaim, InboxError>;

    /// Deletes at most `limit` ids received more than `retention` ago, and as many failure
    /// counts last bumped that long ago; returns how many rows went.
    async fn purge(&self, retention: Duration, limit: u32) -> Result<u64, InboxError>;

    /// Counts one more failure of the handler on `message_id` for `consumer`, in a statement
    /// of its own (the handler's transaction was rolled back), and returns the count so far.
    /// The count lives in the database, beside the inbox: it survives redeliveries,
    /// restarts and other consumers, and only handler failures raise it.
    async fn count_failure(&self, consumer: &str, message_id: &str) -> Result<u32, InboxError>;

    /// The handler failures counted so far on `message_id` for `consumer`, read in the
    /// caller's transaction.
    async fn failures(
        &self,
        conn: &mut <Self::Database as sqlx::Database>::Connection,
        consumer: &str,
        message_id: &str,
    ) -> Result<u32, InboxError>;
}
