//! The step journal on PostgreSQL: its statements.

use sqlx::Postgres;

use super::sql::{
    sealed::{Beside, Dialect},
    SqlJournal, Statements,
};
use crate::{
    sql::{self, statement, TableName},
    store::{PostgresStore, StoreError},
};

/// The step journal on PostgreSQL, in the database of a [`PostgresStore`]. Clones share the
/// pool.
///
/// ```no_run
/// use tower_idempotency::{steps::PostgresJournal, store::PostgresStore};
///
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::new(pool);
/// store.migrate().await?;
/// let journal = PostgresJournal::for_store(&store);
/// journal.migrate().await?;
/// # Ok(()) }
/// ```
pub type PostgresJournal = SqlJournal<Postgres>;

impl Dialect for Postgres {
    const BACKEND: &'static str = "postgres";

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
    scope       TEXT COLLATE \"C\" NOT NULL,
    key         TEXT COLLATE \"C\" NOT NULL,
    step        TEXT COLLATE \"C\" NOT NULL,
    fingerprint BYTEA            NOT NULL,
    output      BYTEA            NOT NULL,
    expires_at  TIMESTAMPTZ      NOT NULL,
    PRIMARY KEY (scope, key, step)
)"
                ),
                format!("CREATE INDEX IF NOT EXISTS {index} ON {t} (expires_at)"),
                format!("CREATE INDEX IF NOT EXISTS {step_index} ON {t} (step, expires_at)"),
            ],
            // FOR SHARE: a takeover (the claim's `ON CONFLICT DO UPDATE` takes the row's
            // lock) waits until this transaction ends, and one that committed first is
            // seen: under READ COMMITTED a locking read re-checks the newest row version.
            fence: statement(format!(
                "SELECT 1 FROM {r}
    WHERE scope = $1 AND key = $2 AND token = $3 AND expires_at > now()
    FOR SHARE"
            )),
            append: statement(format!(
                "INSERT INTO {t} (scope, key, step, fingerprint, output, expires_at)
    VALUES ($1, $2, $3, $4, $5, now() + $6 * interval '1 millisecond')
    ON CONFLICT (scope, key, step) DO UPDATE
        SET fingerprint = excluded.fingerprint,
            output = excluded.output,
            expires_at = excluded.expires_at"
            )),
            entries: statement(format!(
                "SELECT step, output FROM {t}
    WHERE scope = $1 AND key = $2 AND fingerprint = $3 AND expires_at > now()"
            )),
            purge: statement(format!(
                "DELETE FROM {t} WHERE ctid IN (
    SELECT ctid FROM {t} WHERE expires_at <= now() LIMIT $1 FOR UPDATE SKIP LOCKED
) AND expires_at <= now()"
            )),
            orphans: statement(format!(
                "SELECT j.scope, j.key, j.fingerprint, j.output FROM {t} j
    WHERE j.step = $1 AND j.expires_at > now()
    AND NOT EXISTS (SELECT 1 FROM {r} r
        WHERE r.scope = j.scope AND r.key = j.key AND r.expires_at > now())
    AND NOT EXISTS (SELECT 1 FROM {t} f
        WHERE f.scope = j.scope AND f.key = j.key AND f.step = $2
        AND f.fingerprint = j.fingerprint AND f.expires_at > now())
    LIMIT $3"
            )),
            table,
        }
    }
}

impl PostgresJournal {
    /// Creates the table and its index if they do not exist (safe from many processes at
    /// once, like [`PostgresStore::migrate`]).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let schema = self.schema_sql().join(";\n");
        sql::migrate_postgres(self.pool(), self.table().as_str(), &schema)
            .await
            .map_err(|e| sql::backend("postgres", e))
    }
}

impl Beside for PostgresStore {
    type Database = Postgres;

    fn pool(&self) -> &sqlx::Pool<Postgres> {
        PostgresStore::pool(self)
    }

    fn records(&self) -> &TableName {
        self.table()
    }
}
