//! The [`Store`] trait — the one place where the race between duplicates is refereed — and its
//! backends, each behind its own cargo feature.
//!
//! # The contract
//!
//! Every implementation must honour all of the following; the shared conformance suite in
//! `tests/` checks each point against every backend with real servers.
//!
//! 1. **`claim` is one atomic operation.** It either records a new in-progress claim with a
//!    fresh [`Token`] and a lease of the given length, or reports the live record that is
//!    there. A record whose lease ran out, or a completed record past its retention, counts
//!    as absent and is taken over *by the same operation*. Two concurrent `claim`s on one key
//!    never both return [`ClaimOutcome::Claimed`] while the first lease is live. A
//!    lookup followed by an insert is not a claim.
//! 2. **`complete`, `release` and `renew` are fenced by the token.** They act only while the
//!    stored record is in progress under exactly that token. Otherwise they change nothing and
//!    return [`StoreError::StaleToken`].
//! 3. **`lookup` reports only live records** (same expiry rule as `claim`), and may be
//!    called freely by waiters: it never decides who runs.
//! 4. **Clocks are the store's.** Leases and retention are measured by the store's own clock
//!    (the database's `now()`, Redis server time, the process' monotonic clock in memory),
//!    never by a timestamp the application passes in.
//! 5. **Payloads round-trip byte for byte**, including empty and non-UTF-8 payloads.
//! 6. **Errors stay typed**: a failure of the backend is [`StoreError::Backend`] with the
//!    backend's own error as its source; callers treat it as "the store is unavailable".
//!
//! No operation has a default implementation: a default built from other methods could not be
//! atomic. The one default, [`Store::completions`], is not an operation on records but an
//! optional capability (completion notifications, which only make waiters look sooner); a
//! store without it returns `None` and the waiters of other processes poll.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use bytes::Bytes;

use crate::record::{ClaimOutcome, Fingerprint, Record, StoreKey, Token};

mod completions;
mod error;
#[cfg(feature = "memory")]
mod memory;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod pg_notify;
#[cfg(feature = "postgres")]
mod postgres;
mod purger;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "sqlx")]
mod sql_builder;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;

#[cfg(feature = "redis")]
pub use self::redis::{InvalidPrefix, RedisStore, RedisStoreBuilder, ReplicaWaitTimedOut};
#[cfg(any(feature = "postgres", feature = "redis"))]
pub(crate) use completions::{keep_listening, Feed, Sender as CompletionSender};
pub use completions::{Completion, Completions};
pub use error::StoreError;
#[cfg(feature = "memory")]
pub use memory::{MemoryStore, MemoryStoreBuilder};
#[cfg(feature = "mysql")]
pub use mysql::{MySqlStore, MySqlStoreBuilder};
#[cfg(feature = "postgres")]
pub use postgres::{PostgresStore, PostgresStoreBuilder};
pub use purger::spawn_purger;
#[cfg(feature = "sqlx")]
pub use sql_builder::{SqlStore, SqlStoreBuilder};
#[cfg(feature = "sqlite")]
pub use sqlite::{SqliteStore, SqliteStoreBuilder};

/// Storage for idempotency records. See the [module docs](self) for the contract every
/// implementation must keep.
///
/// Implementations are cheap to share: the layer keeps one behind an `Arc`.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Atomically claims `key` for a request with `fingerprint`, or reports the live record
    /// that is already there. A claim lives for `lease` unless renewed or completed.
    async fn claim(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ClaimOutcome, StoreError>;

    /// Extends the lease of the claim held with `token` to `lease` from now (store clock).
    async fn renew(&self, key: &StoreKey, token: Token, lease: Duration) -> Result<(), StoreError>;

    /// Turns the claim held with `token` into a completed record holding `payload`, kept for
    /// `retention` from now (store clock).
    async fn complete(
        &self,
        key: &StoreKey,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<(), StoreError>;

    /// Deletes the claim held with `token`, so that the next `claim` runs the operation again.
    async fn release(&self, key: &StoreKey, token: Token) -> Result<(), StoreError>;

    /// The live record under `key`, if any.
    async fn lookup(&self, key: &StoreKey) -> Result<Option<Record>, StoreError>;

    /// Deletes up to `batch` expired records (expired claims and completed records past their
    /// retention) and returns how many it deleted. Call it repeatedly until it returns less
    /// than `batch` to purge everything; each call is short so it never holds long locks.
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError>;

    /// A subscription to the store's completion notifications, if it has them: every
    /// `complete` and `release` (by any process) is announced with the key's digest, so that
    /// waiters in this process look at once instead of at their next poll. Called inside a
    /// Tokio runtime; the first call starts the store's one listening connection.
    ///
    /// Optional (the default is `None`: waiters poll). A notification is a hint, never
    /// required for correctness: it may be lost, and waiters keep polling at a slower pace.
    ///
    /// PostgreSQL (`LISTEN`/`NOTIFY`, when turned on with
    /// `PostgresStoreBuilder::completion_notifications`) and Redis on one server (pub/sub)
    /// have them. MySQL /
    /// MariaDB and SQLite have no such primitive and Redis Cluster does not use one (see
    /// `RedisStoreBuilder::notify_with`): their waiters in other processes poll, 5 ms doubling to
    /// 250 ms. The memory store serves one process, whose waiters its owners wake directly.
    fn completions(&self) -> Option<Completions> {
        None
    }
}

#[async_trait]
impl<S: Store + ?Sized> Store for Arc<S> {
    async fn claim(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        (**self).claim(key, fingerprint, lease).await
    }

    async fn renew(&self, key: &StoreKey, token: Token, lease: Duration) -> Result<(), StoreError> {
        (**self).renew(key, token, lease).await
    }

    async fn complete(
        &self,
        key: &StoreKey,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<(), StoreError> {
        (**self).complete(key, token, payload, retention).await
    }

    async fn release(&self, key: &StoreKey, token: Token) -> Result<(), StoreError> {
        (**self).release(key, token).await
    }

    async fn lookup(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        (**self).lookup(key).await
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        (**self).purge_expired(batch).await
    }

    fn completions(&self) -> Option<Completions> {
        (**self).completions()
    }
}
