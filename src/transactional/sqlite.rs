//! The transactional mode on SQLite.
//!
//! SQLite has one writer at a time, so this mode serializes writers: the owner's transaction
//! starts with `BEGIN IMMEDIATE`, taking the write lock for as long as the handler runs.
//! Another process' owner waits for it in `BEGIN` (the pool's busy timeout), holding one of
//! its connections meanwhile; duplicates in the owner's own process never reach the database
//! (they wait to be woken). A duplicate's probe is a plain read, which in WAL mode never
//! waits but cannot see an uncommitted claim: it reports such a key as free, and the claim
//! that follows finds it decided once the owner's `BEGIN IMMEDIATE` turn is over.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use bytes::Bytes;
use sqlx::{Sqlite, SqliteConnection};

use super::{
    dialect::{self, Probe, TransactionalStore, TxClaim, TxCommit, TxDialect},
    open_tx::OpenTx,
    WriterQueue,
};
use crate::{
    record::{ClaimOutcome, Fingerprint, StoreKey, Token},
    store::{SqliteStore, Store, StoreError},
};

impl TransactionalStore for SqliteStore {
    type Database = Sqlite;

    fn dialect(&self) -> Arc<dyn TxDialect<Sqlite>> {
        Arc::new(self.clone())
    }
}

#[async_trait]
impl TxDialect<Sqlite> for SqliteStore {
    async fn begin(&self, _idle_limit: Duration) -> Result<OpenTx<Sqlite>, StoreError> {
        // IMMEDIATE: take the write lock now, so the claim's insert can never fail halfway
        // through the transaction because another writer got in first.
        self.pool()
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map(OpenTx::from_sqlx)
            .map_err(|e| StoreError::backend("sqlite", e))
    }

    async fn claim_in(
        &self,
        conn: &mut SqliteConnection,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<TxClaim, StoreError> {
        Ok(match self.claim_on(conn, key, fingerprint, lease).await? {
            ClaimOutcome::Claimed(token) => TxClaim::Claimed(token),
            ClaimOutcome::Existing(record) => TxClaim::Existing(record),
        })
    }

    async fn commit_with(
        &self,
        mut tx: OpenTx<Sqlite>,
        key: &StoreKey,
        _fingerprint: &Fingerprint,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<TxCommit, StoreError> {
        self.complete_held(&mut tx, key, token, payload, retention)
            .await?;
        dialect::commit_sqlx(tx, "sqlite").await?;
        Ok(TxCommit::Committed)
    }

    fn writer_queue(&self) -> Option<&WriterQueue> {
        Some(self.writers())
    }

    fn is_busy(&self, error: &StoreError) -> bool {
        // SQLITE_BUSY (5) and its extended codes: another connection holds the write lock
        // and the pool's busy timeout ran out waiting for it. A `BEGIN IMMEDIATE` that did
        // not finish within the store's time limit was waiting for that lock too (SQLite's
        // busy wait is not fair: another process' writers can keep winning it); sqlx rolls
        // back a `BEGIN` whose caller stopped waiting, so trying again leaks nothing.
        let source = match error {
            StoreError::Timeout { .. } => return true,
            StoreError::Backend { source, .. } => source,
            _ => return false,
        };
        matches!(
            source.downcast_ref::<sqlx::Error>(),
            Some(sqlx::Error::Database(db))
                if db.code().and_then(|code| code.parse::<i32>().ok()).is_some_and(|code| code & 0xff == 5)
        )
    }

    async fn probe(&self, key: &StoreKey) -> Result<Probe, StoreError> {
        Ok(match self.lookup(key).await? {
            Some(record) => Probe::Live(record),
            None => Probe::Absent,
        })
    }
}
