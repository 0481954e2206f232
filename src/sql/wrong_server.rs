//! Connections to a server that cannot take writes, after a failover: a standby, a former
//! primary demoted under the pool's feet, a Galera node cut from its cluster's majority.
//!
//! A pool behind a proxy or a DNS name re-resolves only when it opens a connection. A pooled
//! connection that reached such a server still answers pings, so the pool would lend it out
//! again and again, and every write on it would fail the same way until the process restarts.
//! The store answers that error as "unavailable" (503, the retry comes back) and closes the
//! connection instead of returning it, so the next connection is opened anew and goes where
//! the proxy or the name points now: the new primary.

use std::ops::{Deref, DerefMut};

use sqlx::{pool::PoolConnection, Database, Pool};

use crate::store::StoreError;

/// Whether `error` says this connection's server cannot take writes now: PostgreSQL's
/// `25006` (`read_only_sql_transaction`: a hot standby, or `default_transaction_read_only`);
/// MySQL/MariaDB's 1290 (`--read-only`), 1792 (a read-only transaction) and 1047 (a Galera
/// node that is not part of the primary component: "WSREP has not yet prepared node for
/// application use").
pub(crate) fn is_wrong_server(error: &sqlx::Error) -> bool {
    let Some(db) = error.as_database_error() else {
        return false;
    };
    #[cfg(feature = "postgres")]
    if db
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        .is_some()
    {
        return db.code().as_deref() == Some("25006");
    }
    #[cfg(feature = "mysql")]
    if let Some(mysql) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        return matches!(mysql.number(), 1290 | 1792 | 1047);
    }
    false
}

/// The same test on a store error whose source is a sqlx error.
pub(crate) fn is_wrong_server_store(error: &StoreError) -> bool {
    let source = match error {
        StoreError::Backend { source, .. } | StoreError::CommitOutcomeUnknown { source, .. } => {
            source
        }
        _ => return false,
    };
    source
        .downcast_ref::<sqlx::Error>()
        .is_some_and(is_wrong_server)
}

/// A pooled connection for one store operation, closed instead of going back to the pool when
/// the operation failed because its server cannot take writes. Dereferences to the
/// connection, so it is an executor for sqlx (`&mut *conn`).
pub(crate) struct Checked<DB: Database>(PoolConnection<DB>);

impl<DB: Database> Checked<DB> {
    /// A connection from `pool`; a failure to get one is `backend`'s error.
    pub(crate) async fn acquire(
        pool: &Pool<DB>,
        backend: &'static str,
    ) -> Result<Self, StoreError> {
        pool.acquire()
            .await
            .map(Self)
            .map_err(|error| StoreError::backend(backend, error))
    }

    /// Passes `result` on, marking the connection to be closed if its error says the server
    /// cannot take writes.
    pub(crate) fn check<T>(&mut self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        if let Err(error) = &result {
            if is_wrong_server_store(error) {
                log_closing(error);
                self.0.close_on_drop();
            }
        }
        result
    }
}

impl<DB: Database> Deref for Checked<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        &self.0
    }
}

impl<DB: Database> DerefMut for Checked<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        &mut self.0
    }
}

/// Says why a connection is closed rather than reused.
pub(crate) fn log_closing(error: &dyn std::fmt::Display) {
    tracing::warn!(%error, "the store's server refuses writes (a standby, a demoted primary, a cut-off cluster node?); closing this connection so that the next one finds a writable server");
}
