//! The transactional mode on MySQL / MariaDB.
//!
//! The claim is the separate mode's `INSERT .. ON DUPLICATE KEY UPDATE`, run inside the
//! owner's transaction with a zero lock wait (MariaDB's `SET STATEMENT
//! innodb_lock_wait_timeout = 0 FOR ..`): a key whose row another transaction holds fails at
//! once, which reads as "busy". A duplicate's probe is a locking read that never waits
//! (`LOCK IN SHARE MODE NOWAIT`). Both are MariaDB 10.3+ syntax; MySQL 8 would need the
//! `SET_VAR` hint instead and is not supported by this mode yet.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use bytes::Bytes;
use sqlx::{MySql, MySqlConnection};

use super::{
    dialect::{self, Probe, TransactionalStore, TxClaim, TxCommit, TxDialect},
    open_tx::OpenTx,
};
use crate::{
    record::{ClaimOutcome, Fingerprint, StoreKey, Token},
    store::{
        mysql::{lost_at_commit, Wait},
        MySqlStore, StoreError,
    },
};

impl TransactionalStore for MySqlStore {
    type Database = MySql;

    fn dialect(&self) -> Arc<dyn TxDialect<MySql>> {
        Arc::new(self.clone())
    }
}

#[async_trait]
impl TxDialect<MySql> for MySqlStore {
    async fn begin(&self, _idle_limit: Duration) -> Result<OpenTx<MySql>, StoreError> {
        self.pool()
            .begin()
            .await
            .map(OpenTx::from_sqlx)
            .map_err(|e| StoreError::backend("mysql", e))
    }

    async fn claim_in(
        &self,
        conn: &mut MySqlConnection,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<TxClaim, StoreError> {
        Ok(
            match self
                .claim_on(conn, Wait::Never, key, fingerprint, lease)
                .await?
            {
                Some(ClaimOutcome::Claimed(token)) => TxClaim::Claimed(token),
                Some(ClaimOutcome::Existing(record)) => TxClaim::Existing(record),
                None => TxClaim::Busy,
            },
        )
    }

    async fn commit_with(
        &self,
        mut tx: OpenTx<MySql>,
        key: &StoreKey,
        _fingerprint: &Fingerprint,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<TxCommit, StoreError> {
        // A Galera cluster certifies a transaction at its commit: when another node committed
        // the same key first, this one fails with 1213, at the COMMIT (certification) or at
        // the statement before it (aborted by the winner's write set). Nothing of it persists,
        // and the key is the winner's: answered as a duplicate, like PostgreSQL's unique
        // violation. A plain deadlock on one server gives the same error and also persists
        // nothing; the duplicate's wait then finds the key free and says "not committed".
        let done = match self
            .complete_held(&mut tx, key, token, payload, retention)
            .await
        {
            Ok(()) => dialect::commit_sqlx(tx, "mysql").await,
            Err(error) => Err(error),
        };
        match done {
            Ok(()) => Ok(TxCommit::Committed),
            Err(error) if lost_at_commit(&error) => {
                tracing::debug!(key = %key.log_id(), %error, "the transaction lost its key at the commit (a Galera certification conflict, or a deadlock)");
                Ok(TxCommit::KeyTaken)
            }
            Err(error) => Err(error),
        }
    }

    async fn probe(&self, key: &StoreKey) -> Result<Probe, StoreError> {
        Ok(match MySqlStore::probe(self, key).await? {
            Ok(Some(record)) => Probe::Live(record),
            Ok(None) => Probe::Absent,
            Err(_busy) => Probe::Busy,
        })
    }
}
