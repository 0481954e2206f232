//! Completion notifications on PostgreSQL: `NOTIFY` riding on the statements that settle a
//! key, and one `LISTEN`ing connection per store.
//!
//! The completing (or releasing) statement itself calls `pg_notify` for the row it changed,
//! so a notification costs no round trip and is delivered exactly when the change commits.
//! The transactional mode does not notify (its duplicates wait on the owner's advisory lock,
//! and a notifying commit would serialise every owner's commit). The payload is the key's
//! digest in hex (64 bytes; PostgreSQL allows 8000), never the raw key.

use sqlx::postgres::{PgListener, PgPoolOptions};

use super::{completions, CompletionSender, StoreError};
use crate::record::StoreKey;
use crate::sql::{self, TableName};

/// The channel of `table`'s notifications: a name of its own for each table, so stores on
/// other tables of the database are not woken (two schemas' tables of one name share it,
/// which only costs them a spurious look).
pub(crate) fn channel(table: &TableName) -> String {
    table.derived("settled")
}

/// `statement`, an `UPDATE` or `DELETE` without `RETURNING` whose last parameter is
/// `$(payload - 1)`, made to also notify `channel` with parameter `$payload` when it changed
/// a row. It then answers one row per change, so `rows_affected` still counts them.
pub(crate) fn notifying(statement: &str, channel: &str, payload: usize) -> String {
    // `channel` is a derived table name: letters, digits and `_` only, safe in a literal.
    format!(
        "WITH settled AS ({statement} RETURNING 1) \
         SELECT pg_notify('{channel}', ${payload}) FROM settled"
    )
}

/// A settling statement's query with its last parameter, the payload naming `key` (its
/// digest in hex), bound when the statement notifies.
pub(crate) fn bind_payload<'q>(query: PgQuery<'q>, key: &StoreKey, notifies: bool) -> PgQuery<'q> {
    if notifies {
        query.bind(completions::encode(&key.digest()))
    } else {
        query
    }
}

type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// One listening session: subscribes on a new connection to `pool`'s database, then passes notifications
/// on until the connection is lost. `Err` only when it could not subscribe.
pub(crate) async fn listen(
    pool: sqlx::PgPool,
    channel: String,
    sender: CompletionSender,
) -> Result<(), StoreError> {
    let backend = |error| sql::backend("postgres", error);
    // A connection of its own, not one of the pool's: a listener holds its connection for
    // good, and the pool is sized for requests.
    let own = PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with((*pool.connect_options()).clone());
    let mut listener = PgListener::connect_with(&own).await.map_err(backend)?;
    // Whatever was notified before this LISTEN is lost: `ready` tells the waiters to look.
    listener.listen(&channel).await.map_err(backend)?;
    sender.ready();
    loop {
        match listener.try_recv().await {
            Ok(Some(notification)) => sender.key(notification.payload().as_bytes()),
            Ok(None) => return Ok(()),
            Err(error) => {
                tracing::warn!(%error, "completion listener failed");
                return Ok(());
            }
        }
    }
}
