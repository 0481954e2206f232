//! The step journal on SQLite: its statements.

use sqlx::Sqlite;

use super::sql::{
    sealed::{Beside, Dialect},
    SqlJournal, Statements,
};
use crate::{
    sql::{self, statement, TableName},
    store::{sqlite::NOW_MS, SqliteStore, StoreError},
};

/// The step journal on SQLite, in the database file of a [`SqliteStore`]. Clones share the
/// pool. A step's transaction starts with `BEGIN IMMEDIATE`: it holds the database's one write
/// lock from its fence to its commit, so no takeover can come in between.
pub type SqliteJournal = SqlJournal<Sqlite>;

impl Dialect for Sqlite {
    const BEGIN: Option<&'static str> = Some("BEGIN IMMEDIATE");
    const BACKEND: &'static str = "sqlite";

    fn rows_affected(done: &Self::QueryResult) -> u64 {
        done.rows_affected()
    }

    fn statements(table: TableName, records: &TableName) -> Statements {
        let (t, r) = (table.as_str(), records.as_str());
        let index = table.derived("expires_at_idx");
        // The completer's search starts from one step's entries (`orphans`).
        let step_index = table.derived("step_idx");
        Statements {
            schema: vec![
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (
    scope       TEXT    NOT NULL,
    \"key\"       TEXT    NOT NULL,
    step        TEXT    NOT NULL,
    fingerprint BLOB    NOT NULL,
    output      BLOB    NOT NULL,
    expires_at  INTEGER NOT NULL,
    PRIMARY KEY (scope, \"key\", step)
)"
                ),
                format!("CREATE INDEX IF NOT EXISTS {index} ON {t} (expires_at)"),
                format!("CREATE INDEX IF NOT EXISTS {step_index} ON {t} (step, expires_at)"),
            ],
            fence: statement(format!(
                "SELECT 1 FROM {r}
    WHERE scope = ?1 AND \"key\" = ?2 AND token = ?3 AND expires_at > {NOW_MS}"
            )),
            append: statement(format!(
                "INSERT INTO {t} (scope, \"key\", step, fingerprint, output, expires_at)
    VALUES (?1, ?2, ?3, ?4, ?5, {NOW_MS} + ?6)
    ON CONFLICT (scope, \"key\", step) DO UPDATE
        SET fingerprint = excluded.fingerprint,
            output = excluded.output,
            expires_at = excluded.expires_at"
            )),
            entries: statement(format!(
                "SELECT step, output FROM {t}
    WHERE scope = ?1 AND \"key\" = ?2 AND fingerprint = ?3 AND expires_at > {NOW_MS}"
            )),
            purge: statement(format!(
                "DELETE FROM {t} WHERE rowid IN (
    SELECT rowid FROM {t} WHERE expires_at <= {NOW_MS} LIMIT ?1)"
            )),
            orphans: statement(format!(
                "SELECT j.scope, j.\"key\", j.fingerprint, j.output FROM {t} j
    WHERE j.step = ?1 AND j.expires_at > {NOW_MS}
    AND NOT EXISTS (SELECT 1 FROM {r} r
        WHERE r.scope = j.scope AND r.\"key\" = j.\"key\" AND r.expires_at > {NOW_MS})
    AND NOT EXISTS (SELECT 1 FROM {t} f
        WHERE f.scope = j.scope AND f.\"key\" = j.\"key\" AND f.step = ?2
        AND f.fingerprint = j.fingerprint AND f.expires_at > {NOW_MS})
    LIMIT ?3"
            )),
            table,
        }
    }
}

impl SqliteJournal {
    /// Creates the table and its index if they do not exist.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        sql::execute_each(self.pool(), self.schema_sql())
            .await
            .map_err(|e| sql::backend("sqlite", e))
    }
}

impl Beside for SqliteStore {
    type Database = Sqlite;

    fn pool(&self) -> &sqlx::Pool<Sqlite> {
        SqliteStore::pool(self)
    }

    fn records(&self) -> &TableName {
        self.table()
    }
}
