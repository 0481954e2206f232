//! The outbox on MySQL 8 / MariaDB 10.6+ (both have `FOR UPDATE SKIP LOCKED`).

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use sqlx::SqlStr;
use sqlx::{MySqlConnection, MySqlPool};

use super::{count, NewEvent, OutboxError, OutboxSource, DEFAULT_TABLE};
use crate::broker::Publisher;
use crate::sql::{statement, TableName};

/// The outbox table on MySQL or MariaDB. Clones share the pool. Relays poll (MySQL has no
/// `LISTEN`); set [`RelayConfig::poll_interval`](super::RelayConfig::poll_interval) to the
/// latency you accept.
///
/// ```sql
/// CREATE TABLE IF NOT EXISTS tower_outbox (
///     seq        BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
///     id         VARCHAR(64)  NOT NULL UNIQUE,
///     topic      VARCHAR(255) NOT NULL,
///     payload    LONGBLOB     NOT NULL,
///     created_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
///     sent_at    DATETIME(6)  NULL,
///     INDEX (sent_at, seq)
/// ) ENGINE = InnoDB;
/// ```
#[derive(Clone)]
pub struct MySqlOutbox {
    pool: MySqlPool,
    sql: Arc<Statements>,
}

struct Statements {
    schema: String,
    enqueue: SqlStr,
    take: SqlStr,
    mark: String,
    purge: SqlStr,
    unsent: SqlStr,
}

impl MySqlOutbox {
    /// The outbox in table `tower_outbox`.
    pub fn new(pool: MySqlPool) -> Self {
        Self::with_table(pool, DEFAULT_TABLE).expect("the default table name is valid")
    }

    /// The outbox in another table (optionally `database.table`).
    pub fn with_table(pool: MySqlPool, table: &str) -> Result<Self, OutboxError> {
        let table = TableName::new(table)?;
        let t = table.as_str();
        let index = table.derived("unsent_idx");
        let sql = Statements {
            schema: format!(
                "CREATE TABLE IF NOT EXISTS {t} (
    seq        BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    id         VARCHAR(64)  NOT NULL UNIQUE,
    topic      VARCHAR(255) NOT NULL,
    payload    LONGBLOB     NOT NULL,
    created_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    sent_at    DATETIME(6)  NULL,
    INDEX {index} (sent_at, seq)
) ENGINE = InnoDB"
            ),
            enqueue: statement(format!(
                "INSERT INTO {t} (id, topic, payload) VALUES (?, ?, ?)"
            )),
            take: statement(format!(
                "SELECT seq, id, topic, payload FROM {t} WHERE sent_at IS NULL
                 ORDER BY seq LIMIT ? FOR UPDATE SKIP LOCKED"
            )),
            // Followed by `(?, ?, ...)`, one placeholder per row.
            mark: format!("UPDATE {t} SET sent_at = CURRENT_TIMESTAMP(6) WHERE seq IN "),
            purge: statement(format!(
                "DELETE FROM {t} WHERE sent_at < TIMESTAMPADD(MICROSECOND, -?, CURRENT_TIMESTAMP(6))
                 ORDER BY sent_at LIMIT ?"
            )),
            unsent: statement(format!("SELECT count(*) FROM {t} WHERE sent_at IS NULL")),
        };
        Ok(Self {
            pool,
            sql: Arc::new(sql),
        })
    }

    /// Creates the table if it does not exist. Never touches `_sqlx_migrations`.
    pub async fn migrate(&self) -> Result<(), OutboxError> {
        sqlx::query(sqlx::AssertSqlSafe(self.sql.schema.as_str()))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The DDL [`migrate`](Self::migrate) runs, for your own migrations.
    pub fn schema_sql(&self) -> &str {
        &self.sql.schema
    }

    /// Writes `event` in the caller's transaction; it is published only if that commits.
    pub async fn enqueue(
        &self,
        conn: &mut MySqlConnection,
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
impl OutboxSource for MySqlOutbox {
    async fn relay_batch(
        &self,
        publisher: &dyn Publisher,
        limit: u32,
    ) -> Result<usize, OutboxError> {
        let mut conn = self.pool.acquire().await?;
        // READ COMMITTED for this one transaction: under InnoDB's default REPEATABLE READ the
        // locking read also locks the gaps of the (sent_at, seq) index, which blocks the
        // producers' inserts of new unsent rows and deadlocks with them (1213).
        sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .execute(&mut *conn)
            .await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
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
        let micros = i64::try_from(older_than.as_micros()).unwrap_or(i64::MAX);
        let done = sqlx::query(self.sql.purge.clone())
            .bind(micros)
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
