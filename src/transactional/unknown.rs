//! Which failures of a `COMMIT` leave its outcome unknown.
//!
//! A server that refused the transaction (a unique violation, a serialization failure, a
//! deferred constraint) answered with an error and rolled it back: nothing persists. A
//! connection that broke once the `COMMIT` was on its way (an I/O or protocol error, a pool
//! closed under it, the server ending the session with a FATAL error) says nothing about
//! whether the server committed before it went: the outcome is unknown, and only the next
//! request with the key can learn it. One FATAL error does say: PostgreSQL ends a session for
//! idling in its transaction only before it read the `COMMIT`, so nothing committed.

use sqlx::error::DatabaseError;

use crate::store::StoreError;

/// `error`, raised by a statement that carried or followed a `COMMIT`, as a [`StoreError`]:
/// [`StoreError::CommitOutcomeUnknown`] unless the server itself refused the transaction.
pub(super) fn commit_failed(backend: &'static str, error: sqlx::Error) -> StoreError {
    let refused = match &error {
        sqlx::Error::Database(db) => !ends_session(db.as_ref()),
        // Everything else is about the connection, not the transaction.
        _ => false,
    };
    if refused {
        StoreError::backend(backend, error)
    } else {
        StoreError::CommitOutcomeUnknown {
            backend,
            source: error.into(),
        }
    }
}

/// Whether the server reported an error that ends the session rather than the statement
/// (`pg_terminate_backend`, a shutdown, MariaDB's `KILL`): it may come after the commit.
///
/// Except PostgreSQL's `idle_in_transaction_session_timeout`: the server ends a session for
/// it only while the session sits idle in its transaction, i.e. before it has read the
/// `COMMIT` (or anything after it), so that transaction certainly did not commit.
fn ends_session(error: &dyn DatabaseError) -> bool {
    #[cfg(feature = "postgres")]
    if let Some(pg) = error.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        use sqlx::postgres::PgSeverity;
        /// SQLSTATE `idle_in_transaction_session_timeout`.
        const ENDED_WHILE_IDLE: &str = "25P03";
        return matches!(pg.severity(), PgSeverity::Fatal | PgSeverity::Panic)
            && pg.code() != ENDED_WHILE_IDLE;
    }
    #[cfg(feature = "mysql")]
    if let Some(mysql) = error.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        /// `ER_CONNECTION_KILLED`: the session was killed while the statement ran.
        const CONNECTION_KILLED: u16 = 1927;
        return mysql.number() == CONNECTION_KILLED;
    }
    let _ = error;
    false
}
