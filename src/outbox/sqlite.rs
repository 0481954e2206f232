//! The outbox on SQLite.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use sqlx::SqlStr;
use sqlx::{SqliteConnection, SqlitePool};

use super::{count, NewEvent, OutboxError, OutboxSource, DEFAULT_TABLE};
use crate::broker::Publisher;
use crate::sql::{statement, TableName};
use crate::store::sqlite::NOW_MS;

/// The outbox table on SQLite. Clones share the pool.
///
/// SQLite has one writer: a relay takes the write lock first (`BEGIN IMMEDIATE`) and holds it
/// while the broker confirms the batch, so several relays take turns (none publishes a row
/// another one holds), and producers wait for the lock meanwhile (sqlx's busy timeout, 5 s by
/// default) — keep batches small. Relays poll. Times are milliseconds of SQLite's clock.
#[derive(Clone)]
pub struct SqliteOutbox {
    pool: SqlitePool,
    sql: Arc<Statements>,
}

struct Statements {
    schema: Vec<String>,
    enqueue: SqlStr,
    take: SqlStr,
    mark: String,
    purge: SqlStr,
    unsent: SqlStr,
}

impl SqliteOutbox {
    /// The outbox in table `tower_outbox`.
    pub fn new(pool: SqlitePool) -> Self {
        Self::with_table(pool, DEFAULT_TABLE).expect("the default table name is valid")
    }

    /// The outbox in another table.
    pub fn with_table(pool: SqlitePool, table: &str) -> Result<Self, OutboxError> {
        let table = TableName::new(table)?;
        let t = table.as_str();
        let index = table.derived("unsent_idx");
        let sql = Statements {
            schema: vec![
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    id         TEXT    NOT NULL UNIQUE,
    topic      TEXT    NOT NULL,
    payload    BLOB    NOT NULL,
    created_at INTEGER NOT NULL,
    sent_at    INTEGER
)"
                ),
                format!("CREATE INDEX IF NOT EXISTS {index} ON {t} (sent_at, seq)"),
            ],
            enqueue: statement(format!(
                "INSERT INTO {t} (id, topic, payload, created_at) VALUES (?1, ?2, ?3, {NOW_MS})"
            )),
            take: statement(format!(
                "SELECT seq, id, topic, payload FROM {t} WHERE sent_at IS NULL ORDER BY seq LIMIT ?1"
            )),
            // Followed by `(?, ?, ...)`, one placeholder per row.
            mark: format!("UPDATE {t} SET sent_at = {NOW_MS} WHERE seq IN "),
            purge: statement(format!(
                "DELETE FROM {t} WHERE seq IN (
                     SELECT seq FROM {t} WHERE sent_at < {NOW_MS} - ?1 LIMIT ?2)"
            )),
            unsent: statement(format!("SELECT count(*) FROM {t} WHERE sent_at IS NULL")),
        };
        Ok(Self {
            pool,
            sql: Arc::new(sql),
        })
    }

    /// Creates the table and its index if they do not exist.
    pub async fn migrate(&self) -> Result<(), OutboxError> {
        // Separate autocommit statements, as the SQLite store does: each waits for the write
        // lock on its own, and IF NOT EXISTS makes a concurrent repeat a no-op.
        for statement in &self.sql.schema {
            sqlx::query(sqlx::AssertSqlSafe(statement.as_str()))
                .execute(&self.pool)
                .await?;
        }
        Ok(())
    }

    /// The DDL [`migrate`](Self::migrate) runs, one statement per item.
    pub fn schema_sql(&self) -> &[String] {
        &self.sql.schema
    }

    /// Writes `event` in the caller's transaction; it is published only if that commits.
    pub async fn enqueue(
        &self,
        conn: &mut SqliteConnection,
        event: &NewEvent,
    ) -> Result<(), OutboxError> {
        sqlx::query(self.sql.enqueue.clone())
            .bind(&event.id)
            .bind(&event.topic)
            .bind(&event.payload)
            .execute(conn)
            .await?;
        Ok(())
    }
}

#[async_trait]
impl OutboxSource for SqliteOutbox {
    async fn relay_batch(
        &self,
        publisher: &dyn Publisher,
        limit: u32,
    ) -> Result<usize, OutboxError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let rows = sqlx::query(self.sql.take.clone())
            .bind(limit.max(1))
            .fetch_all(&mut *tx)
            .await?;
        if rows.is_empty() {
            return Ok(0);
        }
        publish_and_mark!(tx, rows, &self.sql.mark, publisher)
    }

    async fn purge_sent(&self, older_than: Duration, limit: u32) -> Result<u64, OutboxError> {
        let millis = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        let done = sqlx::query(self.sql.purge.clone())
            .bind(millis)
            .bind(limit.max(1))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn unsent(&self) -> Result<u64, OutboxError> {
        let n: i64 = sqlx::query_scalar(self.sql.unsent.clone())
            .fetch_one(&self.pool)
            .await?;
        Ok(count(n))
    }
}
