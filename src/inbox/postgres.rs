//! The inbox on PostgreSQL.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use sqlx::SqlStr;
use sqlx::{PgConnection, PgPool, Postgres};

use super::{InboxClaim, InboxError, InboxStore, DEFAULT_TABLE};
use crate::sql::{self, statement, TableName};

/// SQLSTATE `lock_not_available`: the lock timeout passed.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// The inbox table on PostgreSQL. Clones share the pool.
///
/// ```sql
/// CREATE TABLE IF NOT EXISTS tower_inbox (
///     consumer    TEXT COLLATE "C" NOT NULL,
///     message_id  TEXT COLLATE "C" NOT NULL,
///     received_at TIMESTAMPTZ      NOT NULL DEFAULT now(),
///     PRIMARY KEY (consumer, message_id)
/// );
/// ```
///
/// The id columns compare bytewise (`COLLATE "C"`), as message ids are opaque: the primary
/// key's order then never depends on the operating system's language rules, which can
/// change under an index across upgrades. A table made by an earlier version works the same.
#[derive(Clone)]
pub struct PgInbox {
    pool: PgPool,
    lock_timeout: String,
    sql: Arc<Statements>,
}

struct Statements {
    table: TableName,
    schema: String,
    claim: SqlStr,
    purge: SqlStr,
}

impl PgInbox {
    /// The inbox in table `tower_inbox`, with a 100 ms lock timeout for claims.
    pub fn new(pool: PgPool) -> Self {
        Self::with_table(pool, DEFAULT_TABLE).expect("the default table name is valid")
    }

    /// The inbox in another table (optionally `schema.table`).
    pub fn with_table(pool: PgPool, table: &str) -> Result<Self, InboxError> {
        let table = TableName::new(table)?;
        let t = table.as_str();
        let index = table.derived("received_at_idx");
        let sql = Statements {
            schema: format!(
                "CREATE TABLE IF NOT EXISTS {t} (
    consumer    TEXT COLLATE \"C\" NOT NULL,
    message_id  TEXT COLLATE \"C\" NOT NULL,
    received_at TIMESTAMPTZ      NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS {index} ON {t} (received_at);
"
            ),
            // One round trip: set the short lock timeout, insert, put the setting back. The
            // target lists run left to right: `setting` (the FROM) first, then the insert (the
            // first read of `claimed`), then the restore, so only the insert waits briefly.
            claim: statement(format!(
                "WITH setting AS MATERIALIZED (
                     SELECT current_setting('lock_timeout') AS previous,
                            set_config('lock_timeout', $3, true)),
                 claimed AS (
                     INSERT INTO {t} (consumer, message_id) SELECT $1, $2 FROM setting
                     ON CONFLICT DO NOTHING RETURNING 1)
                 SELECT EXISTS (SELECT 1 FROM claimed) AS inserted,
                        set_config('lock_timeout', previous, true)
                 FROM setting"
            )),
            purge: statement(format!(
                "DELETE FROM {t} WHERE ctid IN (
                     SELECT ctid FROM {t} WHERE received_at < now() - $1 * interval '1 millisecond'
                     LIMIT $2)"
            )),
            table,
        };
        Ok(Self {
            pool,
            lock_timeout: "100ms".to_owned(),
            sql: Arc::new(sql),
        })
    }

    /// How long a claim waits for another copy's transaction before answering
    /// [`InboxClaim::Busy`] (default 100 ms; at least 1 ms).
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = format!("{}ms", timeout.as_millis().max(1));
        self
    }

    /// Creates the table if it does not exist (safe when several processes start at once).
    pub async fn migrate(&self) -> Result<(), InboxError> {
        sql::migrate_postgres(&self.pool, self.sql.table.as_str(), &self.sql.schema).await?;
        Ok(())
    }

    /// The DDL [`migrate`](Self::migrate) runs, for your own migrations.
    pub fn schema_sql(&self) -> &str {
        &self.sql.schema
    }
}

#[async_trait]
impl InboxStore for PgInbox {
    type Database = Postgres;

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    async fn claim(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        message_id: &str,
    ) -> Result<InboxClaim, InboxError> {
        let inserted: bool = match sqlx::query_scalar(self.sql.claim.clone())
            .bind(consumer)
            .bind(message_id)
            .bind(&self.lock_timeout)
            .fetch_one(&mut *conn)
            .await
        {
            Ok(inserted) => inserted,
            // The whole statement failed, the restore with it; the transaction is aborted.
            Err(sqlx::Error::Database(error))
                if error.code().as_deref() == Some(LOCK_NOT_AVAILABLE) =>
            {
                return Ok(InboxClaim::Busy)
            }
            Err(error) => return Err(error.into()),
        };
        Ok(if inserted {
            InboxClaim::New
        } else {
            InboxClaim::Duplicate
        })
    }

    async fn purge(&self, retention: Duration, limit: u32) -> Result<u64, InboxError> {
        let millis = retention.as_millis() as f64;
        let done = sqlx::query(self.sql.purge.clone())
            .bind(millis)
            .bind(i64::from(limit.max(1)))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }
}
