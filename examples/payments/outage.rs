//! Which storage failures are outages — the database out of reach, or the session it ended
//! (an operator's `pg_terminate_backend`, MariaDB's `KILL`, a failover, a deadlock's rollback)
//! — as opposed to a fault of this service. An outage is worth a retry: the client is told
//! 503 with `Retry-After`, and in the transactional mode nothing of the request was written.

use std::error::Error;

use tower_idempotency::store::StoreError;

/// Whether `error`, or an error it was caused by, says the database was out of reach or
/// ended the session.
pub fn is_outage(error: &(dyn Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(error) = cause {
        if let Some(sqlx) = error.downcast_ref::<sqlx::Error>() {
            return sqlx_outage(sqlx);
        }
        if let Some(store) = error.downcast_ref::<StoreError>() {
            if matches!(store, StoreError::Timeout { .. }) {
                return true;
            }
        }
        cause = error.source();
    }
    false
}

fn sqlx_outage(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(database) => database.code().is_some_and(|code| {
            // SQLSTATE classes: 08 connection exception, 40 transaction rollback (deadlock,
            // serialization failure), 57P operator intervention (PostgreSQL's shutdowns and
            // terminations), 25P03 idle-in-transaction timeout, 70100 MariaDB's KILL.
            code.starts_with("08")
                || code.starts_with("40")
                || code.starts_with("57P")
                || code == "25P03"
                || code == "70100"
        }),
        _ => false,
    }
}
