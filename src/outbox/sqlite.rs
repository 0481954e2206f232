//! The outbox on SQLite: its statements.

use sqlx::Sqlite;

use super::sql_outbox::{sealed::Dialect, SqlOutbox, Statements};
use super::OutboxError;
use crate::sql::{self, statement, AddedColumn, TableName};
use crate::store::sqlite::NOW_MS;

/// The outbox table on SQLite. Clones share the pool.
///
/// SQLite has one writer: a relay takes the write lock first (`BEGIN IMMEDIATE`) and holds it
/// while the broker confirms the batch, so several relays take turns (none publishes a row
/// another one holds), and producers wait for the lock meanwhile (sqlx's busy timeout, 5 s by
/// default) — keep batches small. Relays poll. Times are milliseconds of SQLite's clock.
pub type SqliteOutbox = SqlOutbox<Sqlite>;

impl Dialect for Sqlite {
    const RELAY_BEGIN: Option<&'static str> = Some("BEGIN IMMEDIATE");

    fn statements(table: TableName) -> Statements {
        let t = table.as_str();
        let index = table.derived("unsent_idx");
        Statements {
            schema: vec![
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    id         TEXT    NOT NULL UNIQUE,
    topic      TEXT    NOT NULL,
    payload    BLOB    NOT NULL,
    created_at INTEGER NOT NULL,
    sent_at    INTEGER,
    ordering_key TEXT
)"
                ),
                format!("CREATE INDEX IF NOT EXISTS {index} ON {t} (sent_at, seq)"),
            ],
            enqueue: statement(format!(
                "INSERT INTO {t} (id, topic, payload, ordering_key, created_at)
                 VALUES (?1, ?2, ?3, ?4, {NOW_MS})"
            )),
            channel: None,
            take: statement(format!(
                "SELECT seq, id, topic, payload, ordering_key FROM {t} WHERE sent_at IS NULL
                 ORDER BY seq LIMIT ?1"
            )),
            // Followed by `(?, ?, ...)`, one placeholder per row.
            mark: statement(format!("UPDATE {t} SET sent_at = {NOW_MS} WHERE seq IN ")),
            purge: statement(format!(
                "DELETE FROM {t} WHERE seq IN (
                     SELECT seq FROM {t} WHERE sent_at < {NOW_MS} - ?1 LIMIT ?2)"
            )),
            unsent: Statements::unsent(&table),
            upgrades: vec![AddedColumn {
                name: "ordering_key",
                add: format!("ALTER TABLE {t} ADD COLUMN ordering_key TEXT"),
            }],
            table,
        }
    }
}

impl SqliteOutbox {
    /// Creates the table and its index if they do not exist.
    pub async fn migrate(&self) -> Result<(), OutboxError> {
        sql::execute_each(&self.pool, self.schema_sql()).await?;
        sql::add_columns(&self.pool, self.sql.table.as_str(), &self.sql.upgrades).await?;
        Ok(())
    }

    /// The DDL [`migrate`](Self::migrate) runs, one statement per item.
    pub fn schema_sql(&self) -> &[String] {
        &self.sql.schema
    }
}
