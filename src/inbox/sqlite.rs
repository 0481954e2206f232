//! The inbox on SQLite: its statements and its claim, which waits for the one writer.

use sqlx::{error::DatabaseError, Sqlite, SqliteConnection};

use super::sql_inbox::{sealed::Dialect, SqlInbox};
use super::InboxError;
use crate::sql::{self, Query};
use crate::store::sqlite::NOW_MS;

/// SQLITE_BUSY and its extended codes (RECOVERY, SNAPSHOT, TIMEOUT).
const BUSY: [&str; 4] = ["5", "261", "517", "773"];

/// The inbox table on SQLite. Clones share the pool.
///
/// SQLite has one writer, so a second copy's claim waits for the write lock (sqlx's busy
/// timeout) and then sees the first copy's outcome: a duplicate if it committed, a fresh
/// claim if it rolled back. Only when the wait runs out is it
/// [`InboxClaim::Busy`](super::InboxClaim::Busy). The waiting copy holds its pool connection
/// meanwhile, which costs nothing extra with one writer.
pub type SqliteInbox = SqlInbox<Sqlite>;

impl Dialect for Sqlite {
    /// None: sqlx's busy timeout is the wait.
    type Wait = ();

    fn default_wait() {}

    fn schema(t: &str, index: &str, f: &str) -> Vec<String> {
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (
    consumer    TEXT    NOT NULL,
    message_id  TEXT    NOT NULL,
    received_at INTEGER NOT NULL,
    PRIMARY KEY (consumer, message_id)
)"
            ),
            format!("CREATE INDEX IF NOT EXISTS {index} ON {t} (received_at)"),
            format!(
                "CREATE TABLE IF NOT EXISTS {f} (
    consumer    TEXT    NOT NULL,
    message_id  TEXT    NOT NULL,
    failures    INTEGER NOT NULL,
    received_at INTEGER NOT NULL,
    PRIMARY KEY (consumer, message_id)
)"
            ),
        ]
    }

    fn count_failure(f: &str) -> String {
        format!(
            "INSERT INTO {f} (consumer, message_id, failures, received_at)
                 VALUES (?1, ?2, 1, {NOW_MS})
                 ON CONFLICT (consumer, message_id)
                 DO UPDATE SET failures = failures + 1, received_at = {NOW_MS}
                 RETURNING failures"
        )
    }

    async fn run_count_failure(
        pool: &sqlx::SqlitePool,
        count: Query<Self>,
    ) -> Result<i64, sqlx::Error> {
        let row = count.fetch_one(pool).await?;
        sqlx::Row::try_get(&row, 0)
    }

    fn failures_of(f: &str) -> String {
        format!("SELECT failures FROM {f} WHERE consumer = ?1 AND message_id = ?2")
    }

    fn claim(t: &str) -> String {
        format!(
            "INSERT OR IGNORE INTO {t} (consumer, message_id, received_at) VALUES (?1, ?2, {NOW_MS})"
        )
    }

    fn purge(t: &str) -> String {
        format!(
            "DELETE FROM {t} WHERE rowid IN (
                     SELECT rowid FROM {t} WHERE received_at < {NOW_MS} - ?1 LIMIT ?2)"
        )
    }

    async fn insert<'c>(
        conn: &'c mut SqliteConnection,
        claim: Query<Self>,
        _: &'c (),
    ) -> Result<bool, sqlx::Error> {
        Ok(claim.execute(conn).await?.rows_affected() == 1)
    }

    fn busy(error: &(dyn DatabaseError + 'static)) -> bool {
        error
            .code()
            .is_some_and(|code| BUSY.contains(&code.as_ref()))
    }
}

impl SqliteInbox {
    /// Creates the tables and the index if they do not exist.
    pub async fn migrate(&self) -> Result<(), InboxError> {
        sql::execute_each(&self.pool, self.schema_sql()).await?;
        Ok(())
    }

    /// The DDL [`migrate`](Self::migrate) runs, one statement per item.
    pub fn schema_sql(&self) -> &[String] {
        &self.sql.schema
    }
}
