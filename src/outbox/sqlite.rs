//! The outbox on SQLite: its statements.

use sqlx::Sqlite;

use std::time::Duration;

use super::sql_outbox::{sealed::Dialect, SqlOutbox, Statements};
use super::OutboxError;
use crate::sql::{self, statement, AddedColumn, OwnTable, Query, TableName};
use crate::store::sqlite::NOW_MS;

/// The outbox table on SQLite. Clones share the pool.
///
/// SQLite has one writer, so a relay never holds the write lock while it waits for the broker:
/// it *leases* a batch in one short write transaction (`BEGIN IMMEDIATE`, the rows get a
/// `leased_until`), publishes outside any transaction, and records the verdicts in a second
/// short one. Producers and other relays write meanwhile; other relays skip leased rows. A
/// relay that dies mid-batch leaves its rows leased until the lease ends (twice the
/// [`publish_timeout`](SqlOutbox::publish_timeout), 60 s by default), and they are published
/// again then. Relays poll. Times are milliseconds of SQLite's clock.
pub type SqliteOutbox = SqlOutbox<Sqlite>;

impl Dialect for Sqlite {
    // The lease and the verdicts are each one write: take the lock at the start, so the
    // transaction never has to upgrade a read lock (which fails at once when another writer
    // got in between, busy timeout or not).
    const RELAY_BEGIN: Option<&'static str> = Some("BEGIN IMMEDIATE");
    const LEASES: bool = true;

    fn bind_take(query: Query<Self>, limit: u32, lease: Duration) -> Query<Self> {
        Self::bind_age(query.bind(i64::from(limit)), lease)
    }

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
    ordering_key TEXT,
    attempts   INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    next_attempt_at INTEGER,
    parked_at  INTEGER,
    leased_until INTEGER
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
                "UPDATE {t} SET leased_until = {NOW_MS} + ?2 WHERE seq IN (
                     SELECT seq FROM {t} WHERE sent_at IS NULL AND parked_at IS NULL
                       AND (next_attempt_at IS NULL OR next_attempt_at <= {NOW_MS})
                       AND (leased_until IS NULL OR leased_until <= {NOW_MS})
                     ORDER BY seq LIMIT ?1)
                 RETURNING seq, id, topic, payload, ordering_key, attempts"
            )),
            // Followed by `(?, ?, ...)`, one placeholder per row.
            mark: statement(format!("UPDATE {t} SET sent_at = {NOW_MS} WHERE seq IN ")),
            release: Some(statement(format!(
                "UPDATE {t} SET leased_until = NULL WHERE seq IN "
            ))),
            retry_later: statement(format!(
                "UPDATE {t} SET attempts = attempts + 1, last_error = ?1,
                     next_attempt_at = {NOW_MS} + ?2, leased_until = NULL
                 WHERE seq = ?3"
            )),
            park: statement(format!(
                "UPDATE {t} SET attempts = attempts + 1, last_error = ?1, parked_at = {NOW_MS},
                     leased_until = NULL
                 WHERE seq = ?2"
            )),
            purge: statement(format!(
                "DELETE FROM {t} WHERE seq IN (
                     SELECT seq FROM {t} WHERE sent_at < {NOW_MS} - ?1 LIMIT ?2)"
            )),
            unsent: Statements::unsent(&table),
            parked: Statements::parked(&table, |n| format!("?{n}")),
            upgrades: [
                ("ordering_key", "TEXT"),
                ("attempts", "INTEGER NOT NULL DEFAULT 0"),
                ("last_error", "TEXT"),
                ("next_attempt_at", "INTEGER"),
                ("parked_at", "INTEGER"),
                ("leased_until", "INTEGER"),
            ]
            .into_iter()
            .map(|(name, kind)| AddedColumn {
                name,
                add: format!("ALTER TABLE {t} ADD COLUMN {name} {kind}"),
            })
            .collect(),
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
