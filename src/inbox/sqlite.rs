//! The inbox on SQLite.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use sqlx::SqlStr;
use sqlx::{Sqlite, SqliteConnection, SqlitePool};

use super::{InboxClaim, InboxError, InboxStore, DEFAULT_TABLE};
use crate::sql::{statement, TableName};
use crate::store::sqlite::NOW_MS;

/// SQLITE_BUSY and its extended codes (RECOVERY, SNAPSHOT, TIMEOUT).
const BUSY: [&str; 4] = ["5", "261", "517", "773"];

/// The inbox table on SQLite. Clones share the pool.
///
/// SQLite has one writer, so a second copy's claim waits for the write lock (sqlx's busy
/// timeout) and then sees the first copy's outcome: a duplicate if it committed, a fresh
/// claim if it rolled back. Only when the wait runs out is it [`InboxClaim::Busy`]. The waiting
/// copy holds its pool connection meanwhile, which costs nothing extra with one writer.
#[derive(Clone)]
pub struct SqliteInbox {
    pool: SqlitePool,
    sql: Arc<Statements>,
}

struct Statements {
    schema: Vec<String>,
    claim: SqlStr,
    purge: SqlStr,
}

impl SqliteInbox {
    /// The inbox in table `tower_inbox`.
    pub fn new(pool: SqlitePool) -> Self {
        Self::with_table(pool, DEFAULT_TABLE).expect("the default table name is valid")
    }

    /// The inbox in another table.
    pub fn with_table(pool: SqlitePool, table: &str) -> Result<Self, InboxError> {
        let table = TableName::new(table)?;
        let t = table.as_str();
        let index = table.derived("received_at_idx");
        let sql = Statements {
            schema: vec![
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (
    consumer    TEXT    NOT NULL,
    message_id  TEXT    NOT NULL,
    received_at INTEGER NOT NULL,
    PRIMARY KEY (consumer, message_id)
)"
                ),
                format!("CREATE INDEX IF NOT EXISTS {index} ON {t} (received_at)"),
            ],
            claim: statement(format!(
                "INSERT OR IGNORE INTO {t} (consumer, message_id, received_at) VALUES (?1, ?2, {NOW_MS})"
            )),
            purge: statement(format!(
                "DELETE FROM {t} WHERE rowid IN (
                     SELECT rowid FROM {t} WHERE received_at < {NOW_MS} - ?1 LIMIT ?2)"
            )),
        };
        Ok(Self {
            pool,
            sql: Arc::new(sql),
        })
    }

    /// Creates the table and its index if they do not exist.
    pub async fn migrate(&self) -> Result<(), InboxError> {
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
}

#[async_trait]
impl InboxStore for SqliteInbox {
    type Database = Sqlite;

    fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    async fn claim(
        &self,
        conn: &mut SqliteConnection,
        consumer: &str,
        message_id: &str,
    ) -> Result<InboxClaim, InboxError> {
        match sqlx::query(self.sql.claim.clone())
            .bind(consumer)
            .bind(message_id)
            .execute(conn)
            .await
        {
            Ok(done) if done.rows_affected() == 1 => Ok(InboxClaim::New),
            Ok(_) => Ok(InboxClaim::Duplicate),
            Err(sqlx::Error::Database(error))
                if error
                    .code()
                    .is_some_and(|code| BUSY.contains(&code.as_ref())) =>
            {
                Ok(InboxClaim::Busy)
            }
            Err(error) => Err(error.into()),
        }
    }

    async fn purge(&self, retention: Duration, limit: u32) -> Result<u64, InboxError> {
        let millis = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        let done = sqlx::query(self.sql.purge.clone())
            .bind(millis)
            .bind(limit.max(1))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }
}
