//! The transactional mode on MySQL / MariaDB.
//!
//! The claim is the separate mode's `INSERT .. ON DUPLICATE KEY UPDATE`, run inside the
//! owner's transaction with a zero lock wait (MariaDB's `SET STATEMENT
//! innodb_lock_wait_timeout = 0 FOR ..`): a key whose row another transaction holds fails at
//! once, which reads as "busy". A duplicate's probe is a locking read that never waits
//! (`LOCK IN SHARE MODE NOWAIT`). Both are MariaDB 10.3+ syntax; MySQL 8 would need the
//! `SET_VAR` hint instead and is not supported by this mode yet.
//!
//! # A transaction the server rolled back
//!
//! InnoDB rolls a whole transaction back when it picks it as a deadlock's victim (error 1213;
//! also a lock wait timeout under `innodb_rollback_on_timeout`), the claim's row with it. The
//! session is then outside any transaction, and a handler that caught the error and carried on
//! would run its next statements in autocommit: their effects would persist at once, without
//! the record, and the retry would run them again. So the owner's session runs with
//! `autocommit = 0` while it owns the key: after such a rollback the handler's next statements
//! open a new transaction of their own instead of committing one by one, and that transaction
//! is never committed. The owner's transaction starts with a savepoint, which the rollback
//! takes with it: the commit releases it first, so it tells its own transaction from one the
//! session opened since. A keyed request whose transaction the server rolled back (its
//! savepoint gone, or the record's `UPDATE` finding no claim row) is answered as a duplicate
//! ([`TxCommit::KeyTaken`], as for a Galera certification conflict): the key is free after a
//! plain deadlock, so the answer is `503` `not-committed`, and nothing of the request persists;
//! unkeyed work fails its commit the same way. (`SET SESSION TRANSACTION READ ONLY` looks like
//! the lighter guard, but MariaDB 10.11 does not apply it to the statements after a deadlock's
//! rollback.)
//!
//! `autocommit` belongs to the session, so the connection must not go back to the pool with
//! it: the crate begins and ends these transactions itself on a pooled connection it holds
//! ([`OpenTx::own`]), turns `autocommit` back on after the `COMMIT` or `ROLLBACK`, and closes the
//! connection on any other way out (an error, a time limit, a cancelled request). It begins
//! them through sqlx's transaction manager, so sqlx knows the connection is in a transaction
//! and a handler's `begin()` on it makes a savepoint, as on a sqlx transaction. The cost: one
//! more round trip to commit or roll back than a sqlx transaction (the manager's own `COMMIT`
//! or `ROLLBACK`, which finds nothing left to end, keeps its count of open transactions right).

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use bytes::Bytes;
use sqlx::{
    mysql::{MySqlDatabaseError, MySqlTransactionManager},
    MySql, MySqlConnection, SqlSafeStr,
};
use sqlx_core::transaction::TransactionManager;

use super::{
    dialect::{Probe, TransactionalStore, TxClaim, TxCommit, TxDialect},
    open_tx::OpenTx,
    unknown,
};
use crate::{
    record::{ClaimOutcome, Fingerprint, StoreKey, Token},
    store::{
        mysql::{lost_at_commit, Wait},
        MySqlStore, StoreError,
    },
};

const BACKEND: &str = "mysql";

/// Opens the owner's transaction, with `autocommit` off and its mark (a savepoint) set.
const BEGIN: &str =
    "SET SESSION autocommit = 0; START TRANSACTION; SAVEPOINT tower_idempotency_owner";

/// Commits the owner's transaction if it is still the one [`BEGIN`] opened (its mark is
/// there), and turns `autocommit` back on.
const COMMIT: &str =
    "RELEASE SAVEPOINT tower_idempotency_owner; COMMIT; SET SESSION autocommit = 1";

/// Rolls back whatever transaction is open, and turns `autocommit` back on.
const ROLLBACK: &str = "ROLLBACK; SET SESSION autocommit = 1";

/// Undoes the operation's writes back to the owner's mark; fails with [`MARK_GONE`] when the
/// server rolled the whole transaction back under the operation.
const ROLLBACK_TO_MARK: &str = "ROLLBACK TO SAVEPOINT tower_idempotency_owner";

/// `ER_SP_DOES_NOT_EXIST`: the mark is gone, with the transaction the server rolled back.
const MARK_GONE: u16 = 1305;

/// The database rolled the owner's transaction back while its operation ran (a deadlock, or
/// a lock wait timeout under `innodb_rollback_on_timeout`): the claim went with it, and what
/// the operation did afterwards was never committed. Nothing of the request persists.
#[derive(Debug, thiserror::Error)]
#[error(
    "the database rolled the idempotency transaction back while the handler ran (a deadlock, \
     or a lock wait timeout with innodb_rollback_on_timeout): nothing of the request persists; \
     answer 5xx so the client retries, rather than catching the deadlock and carrying on"
)]
struct RolledBackByServer(#[source] Option<sqlx::Error>);

impl TransactionalStore for MySqlStore {
    type Database = MySql;

    fn dialect(&self) -> Arc<dyn TxDialect<MySql>> {
        Arc::new(self.clone())
    }
}

/// How [`end`] ends a transaction.
#[derive(Clone, Copy)]
enum End {
    Commit,
    Rollback,
}

/// Commits (if the transaction is still the owner's) or rolls back, turns `autocommit` back
/// on, lets sqlx's transaction manager count the transaction as ended, and gives the
/// connection back to the pool. On an error the transaction is dropped, which closes its
/// connection.
async fn end(mut tx: OpenTx<MySql>, how: End) -> Result<(), StoreError> {
    match how {
        End::Commit => {
            sqlx::raw_sql(COMMIT.into_sql_str())
                .execute(&mut *tx)
                .await
                .map_err(|e| match mysql_error(&e) {
                    Some(MARK_GONE) => StoreError::backend(BACKEND, RolledBackByServer(Some(e))),
                    _ => unknown::commit_failed(BACKEND, e),
                })?;
            // Nothing left to commit: this only counts the transaction out.
            MySqlTransactionManager::commit(&mut tx)
                .await
                .map_err(backend)?;
        }
        End::Rollback => {
            sqlx::raw_sql(ROLLBACK.into_sql_str())
                .execute(&mut *tx)
                .await
                .map_err(backend)?;
            MySqlTransactionManager::rollback(&mut tx)
                .await
                .map_err(backend)?;
        }
    }
    drop(tx.into_connection());
    Ok(())
}

fn backend(error: sqlx::Error) -> StoreError {
    StoreError::backend(BACKEND, error)
}

/// Whether `error` is [`RolledBackByServer`].
fn rolled_back_by_server(error: &StoreError) -> bool {
    matches!(error, StoreError::Backend { source, .. } if source.is::<RolledBackByServer>())
}

/// MySQL's error number in `error`, if the server raised it.
fn mysql_error(error: &sqlx::Error) -> Option<u16> {
    error
        .as_database_error()
        .and_then(|e| e.try_downcast_ref::<MySqlDatabaseError>())
        .map(MySqlDatabaseError::number)
}

#[async_trait]
impl TxDialect<MySql> for MySqlStore {
    async fn begin(&self, _idle_limit: Duration) -> Result<OpenTx<MySql>, StoreError> {
        // Wrapped before anything is sent: dropped from here on, the connection is closed.
        let mut tx = OpenTx::own(self.pool().acquire().await.map_err(backend)?);
        MySqlTransactionManager::begin(&mut tx, Some(BEGIN.into_sql_str()))
            .await
            .map_err(backend)?;
        Ok(tx)
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
        // The server rolled the transaction back before it could commit. A Galera cluster
        // certifies a transaction at its commit: when another node committed the same key
        // first, this one fails with 1213, at the COMMIT (certification) or at the statement
        // before it (aborted by the winner's write set). A deadlock on one server gives the same
        // error; and when the handler caught it and carried on, the record's UPDATE finds the
        // claim's row gone (nobody else can take a row this transaction holds), or the COMMIT
        // finds the owner's mark gone. Nothing of it persists, and the key may be a winner's:
        // answered as a duplicate, like PostgreSQL's unique violation; after a plain deadlock
        // the duplicate's wait finds the key free and says "not committed".
        let done = match self
            .complete_held(&mut tx, key, token, payload, retention)
            .await
        {
            Ok(()) => end(tx, End::Commit).await,
            Err(StoreError::StaleToken) => {
                Err(StoreError::backend(BACKEND, RolledBackByServer(None)))
            }
            Err(error) => Err(error),
        };
        match done {
            Ok(()) => Ok(TxCommit::Committed),
            Err(error) if lost_at_commit(&error) || rolled_back_by_server(&error) => {
                tracing::debug!(key = %key.log_id(), %error, "the transaction lost its key at the commit (a Galera certification conflict, or a deadlock)");
                Ok(TxCommit::KeyTaken)
            }
            Err(error) => Err(error),
        }
    }

    async fn commit(&self, tx: OpenTx<MySql>) -> Result<(), StoreError> {
        end(tx, End::Commit).await
    }

    async fn rollback(&self, tx: OpenTx<MySql>) -> Result<(), StoreError> {
        end(tx, End::Rollback).await
    }

    async fn rollback_lost(&self, mut tx: OpenTx<MySql>) -> Result<bool, StoreError> {
        // Back to the owner's mark first: when the server rolled the transaction back, the
        // mark went with it, and that is how this rollback learns it.
        let lost = match sqlx::raw_sql(ROLLBACK_TO_MARK.into_sql_str())
            .execute(&mut *tx)
            .await
        {
            Ok(_) => false,
            Err(error) if mysql_error(&error) == Some(MARK_GONE) => true,
            Err(error) => return Err(backend(error)),
        };
        end(tx, End::Rollback).await?;
        Ok(lost)
    }

    async fn probe(&self, key: &StoreKey) -> Result<Probe, StoreError> {
        Ok(match MySqlStore::probe(self, key).await? {
            Ok(Some(record)) => Probe::Live(record),
            Ok(None) => Probe::Absent,
            Err(_busy) => Probe::Busy,
        })
    }
}
