//! The outbox on PostgreSQL: its statements and its `LISTEN/NOTIFY` wake-up.

use std::{sync::Arc, time::Duration};

use sqlx::{postgres::PgListener, PgPool, Postgres};
use tokio::sync::Notify;

use super::sql_outbox::{sealed::Dialect, SqlOutbox, Statements};
use super::OutboxError;
use crate::sql::{self, statement, AddedColumn, Query, TableName};

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
pub type PgOutbox = SqlOutbox<Postgres>;

impl Dialect for Postgres {
    fn statements(table: TableName) -> Statements {
        let t = table.as_str();
        let unsent_idx = table.derived("unsent_idx");
        let sent_idx = table.derived("sent_idx");
        Statements {
            channel: Some(table.derived("events")),
            schema: vec![format!(
                "CREATE TABLE IF NOT EXISTS {t} (
    seq        BIGSERIAL        PRIMARY KEY,
    id         TEXT COLLATE \"C\" NOT NULL UNIQUE,
    topic      TEXT             NOT NULL,
    payload    BYTEA            NOT NULL,
    created_at TIMESTAMPTZ      NOT NULL DEFAULT now(),
    sent_at    TIMESTAMPTZ,
    ordering_key TEXT,
    attempts   BIGINT           NOT NULL DEFAULT 0,
    last_error TEXT,
    next_attempt_at TIMESTAMPTZ,
    parked_at  TIMESTAMPTZ
);
CREATE INDEX IF NOT EXISTS {unsent_idx} ON {t} (seq) WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS {sent_idx} ON {t} (sent_at) WHERE sent_at IS NOT NULL;
"
            )],
            // NOTIFY is transactional: it reaches the relays at commit, and never on rollback.
            enqueue: statement(format!(
                "WITH row AS (INSERT INTO {t} (id, topic, payload, ordering_key)
                              VALUES ($1, $2, $3, $4) RETURNING seq)
                 SELECT pg_notify($5, '') FROM row"
            )),
            take: statement(format!(
                "SELECT seq, id, topic, payload, ordering_key, attempts FROM {t}
                 WHERE sent_at IS NULL AND parked_at IS NULL
                   AND (next_attempt_at IS NULL OR next_attempt_at <= now())
                 ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED"
            )),
            mark: statement(format!(
                "UPDATE {t} SET sent_at = now() WHERE seq = ANY($1)"
            )),
            release: None,
            retry_later: statement(format!(
                "UPDATE {t} SET attempts = attempts + 1, last_error = $1,
                     next_attempt_at = now() + $2 * interval '1 millisecond'
                 WHERE seq = $3"
            )),
            park: statement(format!(
                "UPDATE {t} SET attempts = attempts + 1, last_error = $1, parked_at = now()
                 WHERE seq = $2"
            )),
            purge: statement(format!(
                "DELETE FROM {t} WHERE seq IN (
                     SELECT seq FROM {t} WHERE sent_at < now() - $1 * interval '1 millisecond'
                     LIMIT $2)"
            )),
            unsent: Statements::unsent(&table),
            parked: Statements::parked(&table, |n| format!("${n}")),
            upgrades: [AddedColumn {
                name: "ordering_key",
                add: format!("ALTER TABLE {t} ADD COLUMN IF NOT EXISTS ordering_key TEXT"),
            }]
            .into_iter()
            .chain(Statements::refusal_columns(
                &table,
                "IF NOT EXISTS ",
                "TIMESTAMPTZ",
            ))
            .collect(),
            table,
        }
    }

    fn with_seqs(statement: &sqlx::SqlStr, seqs: Vec<i64>) -> Query<Self> {
        sqlx::query(statement.clone()).bind(seqs)
    }

    fn listen(
        pool: &PgPool,
        sql: &Statements,
        wake: Arc<Notify>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let pool = pool.clone();
        let channel = sql.channel.clone()?;
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

impl PgOutbox {
    /// Creates the table and its indexes if they do not exist (safe when several processes
    /// start at once). Never touches `_sqlx_migrations`.
    pub async fn migrate(&self) -> Result<(), OutboxError> {
        let table = self.sql.table.as_str();
        sql::migrate_postgres(&self.pool, table, self.schema_sql()).await?;
        sql::add_columns(&self.pool, table, &self.sql.upgrades).await?;
        Ok(())
    }

    /// The DDL [`migrate`](Self::migrate) runs, for your own migrations.
    pub fn schema_sql(&self) -> &str {
        &self.sql.schema[0]
    }

    /// The `LISTEN` channel relays are woken on: `<table>_events`.
    pub fn channel(&self) -> &str {
        self.sql
            .channel
            .as_deref()
            .expect("the PostgreSQL statements name a channel")
    }
}
