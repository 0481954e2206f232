//! The one outbox code path: [`SqlOutbox`] runs a table of statements each database renders
//! once (its own file: `postgres.rs`, `mysql.rs`, `sqlite.rs`), the way
//! [`SqlStoreBuilder`](crate::store::SqlStoreBuilder) assembles the SQL stores.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use sqlx::{Database, Executor, IntoArguments, Pool, SqlStr};

use super::{count, decode_batch, NewEvent, OutboxError, OutboxSource, DEFAULT_TABLE};
use crate::broker::Publisher;
use crate::sql::{statement, AddedColumn, Query, TableName};

/// The outbox table on one database; use it by its names [`PgOutbox`](super::PgOutbox),
/// [`MySqlOutbox`](super::MySqlOutbox) and [`SqliteOutbox`](super::SqliteOutbox). Clones
/// share the pool.
pub struct SqlOutbox<DB: OutboxDatabase> {
    pub(super) pool: Pool<DB>,
    pub(super) sql: Arc<Statements>,
}

/// A database [`SqlOutbox`] runs on: PostgreSQL, MySQL / MariaDB, SQLite. Implemented by this
/// crate only.
pub trait OutboxDatabase: sealed::Dialect {}

impl<DB: sealed::Dialect> OutboxDatabase for DB {}

pub(crate) mod sealed {
    use std::sync::Arc;

    use tokio::sync::Notify;

    use super::{mark_each, Statements};
    use crate::sql::{OwnTable, Query, TableName};

    /// What differs between databases: the SQL text, how parameters are bound, how a relay's
    /// transaction starts, and the wake-up. The defaults are MySQL's and SQLite's.
    pub trait Dialect: OwnTable {
        /// Sent on the relay's connection before its transaction begins.
        const RELAY_SETUP: Option<&'static str> = None;
        /// The statement that begins the relay's transaction; `None`: sqlx's `BEGIN`.
        const RELAY_BEGIN: Option<&'static str> = None;

        /// The statements for `table`, rendered once.
        fn statements(table: TableName) -> Statements;

        /// Binds the batch size to the `take` statement.
        fn bind_take(query: Query<Self>, limit: u32) -> Query<Self>
        where
            i64: sqlx::Encode<'static, Self> + sqlx::Type<Self>,
        {
            query.bind(i64::from(limit))
        }

        /// The `mark` statement with `seqs` bound: by default `<mark>(?, ?, ...)`, one
        /// placeholder per row (no arrays).
        fn mark(mark: &sqlx::SqlStr, seqs: Vec<i64>) -> Query<Self>
        where
            i64: sqlx::Encode<'static, Self> + sqlx::Type<Self>,
        {
            mark_each(mark, seqs)
        }

        /// Wakes `wake` on every commit that enqueued events, where the database can tell.
        fn listen(
            pool: &sqlx::Pool<Self>,
            sql: &Statements,
            wake: Arc<Notify>,
        ) -> Option<tokio::task::JoinHandle<()>> {
            let _ = (pool, sql, wake);
            None
        }
    }
}

/// The statements of one outbox table, rendered by its database's [`sealed::Dialect`].
// `pub` in a private module, as the sealed trait needs, yet unnameable outside the crate.
pub struct Statements {
    /// The table; PostgreSQL's `migrate` takes its advisory lock on the name.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) table: TableName,
    /// The DDL, one item per statement `migrate` sends (PostgreSQL and MySQL have one).
    pub(crate) schema: Vec<String>,
    /// Binds `id, topic, payload, ordering_key`, then the channel if there is one.
    pub(crate) enqueue: SqlStr,
    /// The `NOTIFY` channel (PostgreSQL), bound last by `enqueue`.
    pub(crate) channel: Option<String>,
    /// Returns `seq, id, topic, payload, ordering_key` of unsent rows in sequence order,
    /// locking them.
    pub(crate) take: SqlStr,
    /// Marks rows sent; how it is completed and bound is the dialect's `mark`.
    pub(crate) mark: SqlStr,
    pub(crate) purge: SqlStr,
    pub(crate) unsent: SqlStr,
    /// The columns added since the table's first release, for tables created before.
    pub(crate) upgrades: Vec<AddedColumn>,
}

impl Statements {
    /// The count of unsent rows, the same text on every database.
    pub(crate) fn unsent(table: &TableName) -> SqlStr {
        statement(format!(
            "SELECT count(*) FROM {} WHERE sent_at IS NULL",
            table.as_str()
        ))
    }
}

impl<DB: OutboxDatabase> Clone for SqlOutbox<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            sql: Arc::clone(&self.sql),
        }
    }
}

impl<DB> SqlOutbox<DB>
where
    DB: OutboxDatabase,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    String: sqlx::Encode<'static, DB> + sqlx::Type<DB>,
    Vec<u8>: sqlx::Encode<'static, DB> + sqlx::Type<DB>,
    Option<String>: sqlx::Encode<'static, DB>,
{
    /// The outbox in table `tower_outbox`.
    pub fn new(pool: Pool<DB>) -> Self {
        Self::with_table(pool, DEFAULT_TABLE).expect("the default table name is valid")
    }

    /// The outbox in another table (optionally qualified: `schema.table` on PostgreSQL,
    /// `database.table` on MySQL).
    pub fn with_table(pool: Pool<DB>, table: &str) -> Result<Self, OutboxError> {
        let sql = DB::statements(TableName::new(table)?);
        Ok(Self {
            pool,
            sql: Arc::new(sql),
        })
    }

    /// Writes `event` in the caller's transaction (pass `&mut tx` or `&mut *tx`, or any
    /// connection). It is published only if that transaction commits.
    pub async fn enqueue(
        &self,
        conn: &mut DB::Connection,
        event: &NewEvent,
    ) -> Result<(), OutboxError> {
        let mut query = sqlx::query(self.sql.enqueue.clone())
            .bind(&event.id)
            .bind(&event.topic)
            .bind(&event.payload)
            .bind(&event.key);
        if let Some(channel) = &self.sql.channel {
            query = query.bind(channel);
        }
        query.execute(conn).await?;
        Ok(())
    }
}

#[async_trait]
impl<DB> OutboxSource for SqlOutbox<DB>
where
    DB: OutboxDatabase,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'r> i64: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'static, DB>,
    for<'r> String: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> Vec<u8>: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> Option<String>: sqlx::Decode<'r, DB>,
    for<'c> &'c str: sqlx::ColumnIndex<DB::Row>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    async fn relay_batch(
        &self,
        publisher: &dyn Publisher,
        limit: u32,
    ) -> Result<usize, OutboxError> {
        let mut conn = self.pool.acquire().await?;
        if let Some(setup) = DB::RELAY_SETUP {
            sqlx::query(setup).execute(&mut *conn).await?;
        }
        let mut tx = match DB::RELAY_BEGIN {
            Some(begin) => sqlx::Connection::begin_with(&mut *conn, begin).await?,
            None => sqlx::Connection::begin(&mut *conn).await?,
        };
        let rows = DB::bind_take(sqlx::query(self.sql.take.clone()), limit.max(1))
            .fetch_all(&mut *tx)
            .await?;
        if rows.is_empty() {
            return Ok(0);
        }
        let (seqs, messages) = decode_batch(rows)?;
        // The rows stay locked (SQLite: the write lock stays held) across the publish, so
        // other relays skip them instead of publishing them too. A crash from here to the
        // commit leaves them unsent.
        let verdicts = publisher.publish_confirmed(&messages).await?;
        let accepted = accepted(&seqs, &messages, &verdicts)?;
        if !accepted.is_empty() {
            let sent = accepted.len();
            DB::mark(&self.sql.mark, accepted).execute(&mut *tx).await?;
            tx.commit().await?;
            return Ok(sent);
        }
        Ok(0)
    }

    async fn purge_sent(&self, older_than: Duration, limit: u32) -> Result<u64, OutboxError> {
        let query = sqlx::query(self.sql.purge.clone());
        Ok(DB::run_purge(&self.pool, query, older_than, limit.max(1)).await?)
    }

    async fn unsent(&self) -> Result<u64, OutboxError> {
        let n: i64 = sqlx::query_scalar(self.sql.unsent.clone())
            .fetch_one(&self.pool)
            .await?;
        Ok(count(n))
    }

    fn listen(&self, wake: Arc<tokio::sync::Notify>) -> Option<tokio::task::JoinHandle<()>> {
        DB::listen(&self.pool, &self.sql, wake)
    }
}

/// The sequence numbers of the rows the broker took; refused rows stay unsent. A publisher
/// that answers for a different number of messages broke its contract: nothing is known.
fn accepted(
    seqs: &[i64],
    messages: &[crate::broker::OutgoingMessage],
    verdicts: &[crate::broker::Verdict],
) -> Result<Vec<i64>, OutboxError> {
    if verdicts.len() != messages.len() {
        return Err(OutboxError::Verdicts {
            messages: messages.len(),
            verdicts: verdicts.len(),
        });
    }
    for (message, verdict) in messages.iter().zip(verdicts) {
        if let Err(refusal) = verdict {
            tracing::warn!(event_id = %message.id, topic = %message.topic, "outbox: {refusal}; the row stays unsent");
        }
    }
    Ok(seqs
        .iter()
        .zip(verdicts)
        .filter(|(_, verdict)| verdict.is_ok())
        .map(|(seq, _)| *seq)
        .collect())
}

/// The `mark` of the dialects without arrays (MySQL, SQLite): `<prefix>(?, ?, ...)`, one
/// placeholder per row, each bound to its sequence number.
fn mark_each<DB>(prefix: &SqlStr, seqs: Vec<i64>) -> Query<DB>
where
    DB: Database,
    i64: sqlx::Encode<'static, DB> + sqlx::Type<DB>,
{
    let mark = super::with_placeholders(prefix.as_str(), seqs.len());
    let mut query = sqlx::query(sqlx::AssertSqlSafe(mark));
    for seq in seqs {
        query = query.bind(seq);
    }
    query
}
