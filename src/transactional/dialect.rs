//! What a SQL database must offer for the transactional mode: a claim that runs inside the
//! caller's transaction and never waits for another transaction's claim.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use bytes::Bytes;
use sqlx::Transaction;

use crate::{
    record::{Fingerprint, Record, StoreKey, Token},
    store::{Store, StoreError},
};

/// What a claim inside a transaction found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxClaim {
    /// The transaction now holds the key (an uncommitted row): run the operation, then
    /// complete and commit, or roll back. Nobody else can claim the key until this
    /// transaction ends, and if it rolls back or its connection dies, nothing of it remains.
    Claimed(Token),
    /// A committed live record is there (the operation already ran, or a claim of the
    /// separate mode is running).
    Existing(Record),
    /// Another transaction holds the key right now. The claim did not wait for it: roll back,
    /// give the connection back, and wait somewhere cheaper.
    Busy,
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
/// - [`complete_in`](Self::complete_in) turns the caller's uncommitted claim into a completed
///   record in the same transaction: the record commits together with the operation's writes.
/// - [`probe`](Self::probe) runs outside any transaction, takes no lock that outlives it, and
///   tells a committed record, a running transaction and a free key apart.
#[async_trait]
pub trait TxDialect<DB: sqlx::Database>: Send + Sync + 'static {
    /// Opens the owner's transaction on a pooled connection. `idle_limit` bounds how long the
    /// transaction may sit idle (an owner that hangs without dying) where the database can
    /// enforce it.
    async fn begin(&self, idle_limit: Duration) -> Result<Transaction<'static, DB>, StoreError>;

    /// Claims `key` inside the transaction `conn` is in. The claim row is visible to nobody
    /// else before it commits, completed; `lease` is its expiry should it ever be committed
    /// while still in progress (a handler that commits the transaction itself), so that it
    /// then ends like a claim of the separate mode.
    async fn claim_in(
        &self,
        conn: &mut DB::Connection,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<TxClaim, StoreError>;

    /// Stores `payload` as the outcome of the claim made with `token`, kept for `retention`,
    /// in the same transaction.
    async fn complete_in(
        &self,
        conn: &mut DB::Connection,
        key: &StoreKey,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<(), StoreError>;

    /// What a duplicate waiting for `key` sees, outside any transaction.
    async fn probe(&self, key: &StoreKey) -> Result<Probe, StoreError>;
}

/// A SQL [`Store`] that also supports the transactional mode: one of the sqlx stores.
pub trait TransactionalStore: Store + Clone {
    /// The sqlx database the store runs on.
    type Database: sqlx::Database;

    /// The transactional operations on this store's pool and table.
    fn dialect(&self) -> Arc<dyn TxDialect<Self::Database>>;
}
