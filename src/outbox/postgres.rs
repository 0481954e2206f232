//! The outbox on PostgreSQL.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use sqlx::SqlStr;
use sqlx::{postgres::PgListener, PgConnection, PgPool};
use tokio::sync::Notify;

use super::{count, decode_batch, NewEvent, OutboxError, OutboxSource, DEFAULT_TABLE};
use crate::broker::Publisher;
use crate::sql::{self, statement, TableName};

/// The outbox table on PostgreSQL. Clones share the pool.
///
/// ```no_run
/// use tower_idempotency::outbox::{NewEvent, PgOutbox};
///
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let outbox = PgOutbox::new(pool.clone());
/// outbox.migrate().await?;
/// let mut tx = pool.begin().await?;
/// // ... your own writes in `tx` ...
/// outbox.enqueue(&mut tx, &NewEvent::new("payment.created", r#"{"id":1}"#)).await?;
/// tx.commit().await?; // the relay is woken up now; a rollback would publish nothing
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgOutbox {
    pool: PgPool,
    sql: Arc<Statements>,
}

struct Statements {
    table: TableName,
    channel: String,
    schema: String,
    enqueue: SqlStr,
    take: SqlStr,
    mark: SqlStr,
    purge: SqlStr,
    unsent: SqlStr,
}

impl PgOutbox {
    /// The outbox in table `tower_outbox`.
    pub fn new(pool: PgPool) -> Self {
        Self::with_table(pool, DEFAULT_TABLE).expect("the default table name is valid")
    }

    /// The outbox in another table (optionally `schema.table`).
    pub fn with_table(pool: PgPool, table: &str) -> Result<Self, OutboxError> {
        let table = TableName::new(table)?;
        let t = table.as_str();
        let unsent_idx = table.derived("unsent_idx");
        let sent_idx = table.derived("sent_idx");
        let sql = Statements {
            channel: table.derived("events"),
            schema: format!(
                "CREATE TABLE IF NOT EXISTS {t} (
    seq        BIGSERIAL        PRIMARY KEY,
    id         TEXT COLLATE \"C\" NOT NULL UNIQUE,
    topic      TEXT             NOT NULL,
    payload    BYTEA            NOT NULL,
    created_at TIMESTAMPTZ      NOT NULL DEFAULT now(),
    sent_at    TIMESTAMPTZ
);
CREATE INDEX IF NOT EXISTS {unsent_idx} ON {t} (seq) WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS {sent_idx} ON {t} (sent_at) WHERE sent_at IS NOT NULL;
"
            ),
            // NOTIFY is transactional: it reaches the relays at commit, and never on rollback.
            enqueue: statement(format!(
                "WITH row AS (INSERT INTO {t} (id, topic, payload) VALUES ($1, $2, $3) RETURNING seq)
                 SELECT pg_notify($4, '') FROM row"
            )),
            take: statement(format!(
                "SELECT seq, id, topic, payload FROM {t} WHERE sent_at IS NULL
                 ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED"
            )),
            mark: statement(format!("UPDATE {t} SET sent_at = now() WHERE seq = ANY($1)")),
            purge: statement(format!(
                "DELETE FROM {t} WHERE seq IN (
                     SELECT seq FROM {t} WHERE sent_at < now() - $1 * interval '1 millisecond'
                     LIMIT $2)"
            )),
            unsent: statement(format!("SELECT count(*) FROM {t} WHERE sent_at IS NULL")),
            table,
        };
        Ok(Self {
            pool,
            sql: Arc::new(sql),
        })
    }

    /// Creates the table and its indexes if they do not exist (safe when several processes
    /// start at once). Never touches `_sqlx_migrations`.
    pub async fn migrate(&self) -> Result<(), OutboxError> {
        sql::migrate_postgres(&self.pool, self.sql.table.as_str(), &self.sql.schema).await?;
        Ok(())
    }

    /// The DDL [`migrate`](Self::migrate) runs, for your own migrations.
    pub fn schema_sql(&self) -> &str {
        &self.sql.schema
    }

    /// The `LISTEN` channel relays are woken on: `<table>_events`.
    pub fn channel(&self) -> &str {
        &self.sql.channel
    }

    /// Writes `event` in the caller's transaction (pass `&mut tx` or `&mut *tx`, or any
    /// connection). It is published only if that transaction commits.
    pub async fn enqueue(
        &self,
        conn: &mut PgConnection,
        event: &NewEvent,
    ) -> Result<(), OutboxError> {
        sqlx::query(self.sql.enqueue.clone())
            .bind(&event.id)
            .bind(&event.topic)
            .bind(&event.payload)
            .bind(&self.sql.channel)
            .execute(conn)
            .await?;
        Ok(())
    }
}

#[async_trait]
impl OutboxSource for PgOutbox {
    async fn relay_batch(
        &self,
        publisher: &dyn Publisher,
        limit: u32,
    ) -> Result<usize, OutboxError> {
        let mut tx = self.pool.begin().await?;
        let rows = sqlx::query(self.sql.take.clone())
            .bind(i64::from(limit.max(1)))
            .fetch_all(&mut *tx)
            .await?;
        if rows.is_empty() {
            return Ok(0);
        }
        let (seqs, messages) = decode_batch(rows)?;
        // The row locks are held across the publish: another relay skips these rows instead
        // of publishing them too. A crash from here to the commit leaves them unsent.
        publisher.publish_confirmed(&messages).await?;
        sqlx::query(self.sql.mark.clone())
            .bind(&seqs)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(messages.len())
    }

    async fn purge_sent(&self, older_than: Duration, limit: u32) -> Result<u64, OutboxError> {
        let millis = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        let done = sqlx::query(self.sql.purge.clone())
            .bind(millis as f64)
            .bind(i64::from(limit.max(1)))
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

    fn listen(&self, wake: Arc<Notify>) -> Option<tokio::task::JoinHandle<()>> {
        let pool = self.pool.clone();
        let channel = self.sql.channel.clone();
        Some(tokio::spawn(async move {
            loop {
                let mut listener = match PgListener::connect_with(&pool).await {
                    Ok(listener) => listener,
                    Err(error) => {
                        tracing::warn!(%error, "outbox: LISTEN failed; polling until it works");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                };
                if let Err(error) = listener.listen(&channel).await {
                    tracing::warn!(%error, "outbox: LISTEN failed; polling until it works");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
                // `recv` reconnects by itself; a notification lost meanwhile is covered by
                // polling, and the relay drains on every wake-up.
                while listener.recv().await.is_ok() {
                    wake.notify_one();
                }
            }
        }))
    }
}
