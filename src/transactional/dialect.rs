//! What a SQL database must offer for the transactional mode: a claim that runs inside the
//! caller's transaction and never waits for another transaction's claim.

use std::{sync::Arc, time::Duration};

use super::{open_tx::OpenTx, turn::WriterQueue};
use crate::{
    record::{Fingerprint, Record, StoreKey, Token},
    store::{Store, StoreError},
};
use async_trait::async_trait;
use bytes::Bytes;

/// What a claim inside a transaction found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxClaim {
    /// The transaction now holds the key (an uncommitted row, or on PostgreSQL a
    /// transaction-scoped lock): run the operation, then complete and commit, or roll back.
    /// Nobody else can claim the key until this transaction ends, and if it rolls back or its
    /// connection dies, nothing of it remains.
    Claimed(Token),
    /// A committed live record is there (the operation already ran, or a claim of the
    /// separate mode is running).
    Existing(Record),
    /// Another transaction holds the key right now. The claim did not wait for it: roll back,
    /// give the connection back, and wait somewhere cheaper.
    Busy,
}

/// How [`TxDialect::commit_with`] ended when it raised no error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxCommit {
    /// The outcome and the operation's writes committed together.
    Committed,
    /// Another request recorded the key first, so nothing was committed: the transaction,
    /// the operation's writes included, is rolled back. Answer as a duplicate.
    KeyTaken,
}

/// What [`TxDialect::begin_claim`] found: a transaction that holds the key, or why there is
/// none (the transaction it opened, if any, is already rolled back).
pub enum TxStart<DB: sqlx::Database> {
    /// The transaction holds the key: see [`TxClaim::Claimed`].
    Owner {
        /// The owner's transaction.
        tx: OpenTx<DB>,
        /// The claim's token.
        token: Token,
    },
    /// See [`TxClaim::Existing`].
    Existing(Record),
    /// See [`TxClaim::Busy`].
    Busy,
}

impl<DB: sqlx::Database> std::fmt::Debug for TxStart<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Owner { token, .. } => f.debug_struct("Owner").field("token", token).finish(),
            Self::Existing(record) => f.debug_tuple("Existing").field(record).finish(),
            Self::Busy => f.write_str("Busy"),
        }
    }
}

/// What a duplicate sees from outside any transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// A committed live record.
    Live(Record),
    /// No committed record, but a transaction is running the key now.
    Busy,
    /// Nothing: the key is free (never used, rolled back, or expired).
    Absent,
}

/// The transactional operations of one SQL dialect on one records table.
///
/// Implemented for PostgreSQL, MySQL/MariaDB and SQLite; another database can implement it
/// and use [`Transactional`](super::Transactional) unchanged. The contract:
///
/// - [`claim_in`](Self::claim_in) is one atomic decision inside the caller's transaction and
///   never blocks on another transaction's uncommitted claim of the same key (it answers
///   [`TxClaim::Busy`] instead), so a waiting duplicate never holds a pooled connection.
/// - [`commit_with`](Self::commit_with) writes the completed record in the caller's
///   transaction and commits it: the record commits together with the operation's writes,
///   or nothing does.
/// - [`probe`](Self::probe) runs outside any transaction, takes no lock that outlives it, and
///   tells a committed record, a running transaction and a free key apart.
#[async_trait]
pub trait TxDialect<DB: sqlx::Database>: Send + Sync + 'static {
    /// Opens the owner's transaction on a pooled connection. `idle_limit` bounds how long the
    /// transaction may sit idle (an owner that hangs without dying) where the database can
    /// enforce it.
    async fn begin(&self, idle_limit: Duration) -> Result<OpenTx<DB>, StoreError>;

    /// Claims `key` inside the transaction `conn` is in. Whatever the claim writes is visible
    /// to nobody else before it commits, completed; where it writes a row, `lease` is that
    /// row's expiry should it ever be committed while still in progress (a handler that
    /// commits the transaction itself), so that it then ends like a claim of the separate
    /// mode. A dialect whose claim is a lock may write nothing here and the whole record in
    /// [`commit_with`](Self::commit_with).
    async fn claim_in(
        &self,
        conn: &mut DB::Connection,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<TxClaim, StoreError>;

    /// Stores `payload` as the outcome of the claim made with `token` (of a request with
    /// `fingerprint`), kept for `retention`, in the transaction `tx`, and commits it. On an
    /// error, or [`TxCommit::KeyTaken`], nothing of the transaction persists (unless the
    /// connection broke during the `COMMIT` itself, when the outcome is unknown).
    async fn commit_with(
        &self,
        tx: OpenTx<DB>,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<TxCommit, StoreError>;

    /// Commits `tx` as it is (unkeyed work: no outcome to store). The default commits a sqlx
    /// transaction; a dialect that begins transactions itself overrides it.
    async fn commit(&self, tx: OpenTx<DB>) -> Result<(), StoreError> {
        commit_sqlx(tx, "sql").await
    }

    /// Rolls `tx` back, and says whether the database had rolled it back already, under the
    /// operation (a deadlock's victim, or a Galera node aborting it for a write set that
    /// certified first): the claim went with it, so the key may be someone else's by now.
    /// The default cannot tell and says no; a dialect whose database rolls transactions back
    /// on its own overrides it.
    async fn rollback_lost(&self, tx: OpenTx<DB>) -> Result<bool, StoreError> {
        self.rollback(tx).await.map(|()| false)
    }

    /// Rolls `tx` back. The default rolls back a sqlx transaction; a dialect that begins
    /// transactions itself overrides it.
    async fn rollback(&self, tx: OpenTx<DB>) -> Result<(), StoreError> {
        match tx.into_sqlx() {
            Some(tx) => tx
                .rollback()
                .await
                .map_err(|e| StoreError::backend("sql", e)),
            // Not sqlx's: dropping it closes the connection, which rolls back.
            None => Ok(()),
        }
    }

    /// What a duplicate waiting for `key` sees, outside any transaction.
    async fn probe(&self, key: &StoreKey) -> Result<Probe, StoreError>;

    /// Whether [`await_owner`](Self::await_owner) can block until a key's owner ends. A
    /// duplicate's watch then looks at the database only as a slow fallback.
    fn can_await_owner(&self) -> bool {
        false
    }

    /// Waits, at most about `at_most`, for the transaction running `key` to end (commit or
    /// roll back), outside any transaction of the caller and without a connection of the
    /// request pool. `Ok(true)`: it ended, look now; `Ok(false)`: still running, or this
    /// dialect cannot wait for it (the default), so poll.
    async fn await_owner(&self, key: &StoreKey, at_most: Duration) -> Result<bool, StoreError> {
        let _ = (key, at_most);
        Ok(false)
    }

    /// Where the database has one writer at a time (SQLite), the queue in which this
    /// process' owners take turns before they [`begin_claim`](Self::begin_claim): they wait
    /// there without a connection, in order, for as long as their request may wait. `None`
    /// (the default): owners of different keys write side by side.
    fn writer_queue(&self) -> Option<&WriterQueue> {
        None
    }

    /// Whether `error`, from [`begin_claim`](Self::begin_claim), says only that another
    /// writer holds the database (SQLite's `SQLITE_BUSY` after its busy timeout): the owner
    /// tries again while its request may still wait, and is told "busy", not "unavailable".
    /// Only asked of dialects with a [`writer_queue`](Self::writer_queue).
    fn is_busy(&self, error: &StoreError) -> bool {
        let _ = error;
        false
    }

    /// [`begin`](Self::begin) and [`claim_in`](Self::claim_in) together, as the owner of a
    /// new key does. The default runs one after the other (two round trips); a dialect that
    /// can open the transaction and claim in one round trip overrides it.
    async fn begin_claim(
        &self,
        idle_limit: Duration,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<TxStart<DB>, StoreError> {
        begin_then_claim(self, idle_limit, key, fingerprint, lease).await
    }
}

/// [`TxDialect::begin_claim`] in two steps: [`TxDialect::begin`], then
/// [`TxDialect::claim_in`]. Unless claimed, dropping the transaction rolls it back.
pub(super) async fn begin_then_claim<DB: sqlx::Database, D: TxDialect<DB> + ?Sized>(
    dialect: &D,
    idle_limit: Duration,
    key: &StoreKey,
    fingerprint: &Fingerprint,
    lease: Duration,
) -> Result<TxStart<DB>, StoreError> {
    let mut tx = dialect.begin(idle_limit).await?;
    Ok(
        match dialect.claim_in(&mut tx, key, fingerprint, lease).await? {
            TxClaim::Claimed(token) => TxStart::Owner { tx, token },
            TxClaim::Existing(record) => TxStart::Existing(record),
            TxClaim::Busy => TxStart::Busy,
        },
    )
}

/// Commits a sqlx transaction; a broken connection during the `COMMIT` is
/// [`StoreError::CommitOutcomeUnknown`]. A crate-owned one cannot be committed here (this code does not
/// know its dialect): it is dropped, which rolls it back, and the caller is told.
pub(super) async fn commit_sqlx<DB: sqlx::Database>(
    tx: OpenTx<DB>,
    backend: &'static str,
) -> Result<(), StoreError> {
    match tx.into_sqlx() {
        Some(tx) => tx
            .commit()
            .await
            .map_err(|e| super::unknown::commit_failed(backend, e)),
        None => Err(StoreError::backend(backend, NotSqlx)),
    }
}

/// A dialect that begins its own transactions left [`TxDialect::commit`] as the default.
#[derive(Debug, thiserror::Error)]
#[error(
    "this transaction was begun by its dialect, which must commit it itself (TxDialect::commit)"
)]
struct NotSqlx;

/// A SQL [`Store`] that also supports the transactional mode: one of the sqlx stores.
pub trait TransactionalStore: Store + Clone {
    /// The sqlx database the store runs on.
    type Database: sqlx::Database;

    /// The transactional operations on this store's pool and table.
    fn dialect(&self) -> Arc<dyn TxDialect<Self::Database>>;
}
