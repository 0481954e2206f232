//! The step journal on MySQL / MariaDB: its statements.

use sqlx::MySql;

use super::sql::{
    sealed::{Beside, Dialect},
    SqlJournal, Statements,
};
use crate::{
    sql::{self, statement, TableName},
    store::{
        mysql::{MAX_KEY_BYTES, NOW},
        MySqlStore, StoreError,
    },
};

/// The step journal on MySQL or MariaDB (InnoDB), in the database of a [`MySqlStore`]. Clones
/// share the pool. A step's transaction reads the claim with `LOCK IN SHARE MODE`: a takeover
/// (the claim's `INSERT .. ON DUPLICATE KEY UPDATE` needs the row's exclusive lock) waits for
/// the step's commit, and a locking read sees the newest committed row even under
/// `REPEATABLE READ`.
///
/// ```no_run
/// use tower_idempotency::{steps::MySqlJournal, store::MySqlStore};
///
/// # async fn example(pool: sqlx::MySqlPool) -> Result<(), Box<dyn std::error::Error>> {
/// let store = MySqlStore::new(pool);
/// store.migrate().await?;
/// let journal = MySqlJournal::for_store(&store);
/// journal.migrate().await?;
/// # Ok(()) }
/// ```
pub type MySqlJournal = SqlJournal<MySql>;

/// The width of the step column: with scope and key (1020 bytes each) the primary key stays
/// within InnoDB's 3072-byte limit.
const MAX_STEP_BYTES: usize = 1020;

impl Dialect for MySql {
    const BACKEND: &'static str = "mysql";

    fn rows_affected(done: &Self::QueryResult) -> u64 {
        done.rows_affected()
    }

    fn statements(table: TableName, records: &TableName) -> Statements {
        let (t, r) = (table.as_str(), records.as_str());
        // Byte strings, compared byte for byte, as in the records table (a `_bin` VARCHAR
        // would still ignore trailing spaces); one statement with a table-local index name.
        let expires = format!("{NOW} + INTERVAL (? * 1000) MICROSECOND");
        Statements {
            schema: vec![format!(
                "CREATE TABLE IF NOT EXISTS {t} (
    scope       VARBINARY({MAX_KEY_BYTES}) NOT NULL,
    `key`       VARBINARY({MAX_KEY_BYTES}) NOT NULL,
    step        VARBINARY({MAX_STEP_BYTES}) NOT NULL,
    fingerprint BINARY(32)      NOT NULL,
    output      LONGBLOB        NOT NULL,
    expires_at  DATETIME(3)     NOT NULL,
    PRIMARY KEY (scope, `key`, step),
    INDEX idx_expires_at (expires_at),
    INDEX idx_step (step, expires_at)
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC"
            )],
            fence: statement(format!(
                "SELECT 1 FROM {r}
    WHERE scope = ? AND `key` = ? AND token = ? AND expires_at > {NOW}
    LOCK IN SHARE MODE"
            )),
            append: statement(format!(
                "INSERT INTO {t} (scope, `key`, step, fingerprint, output, expires_at)
    VALUES (?, ?, ?, ?, ?, {expires})
    ON DUPLICATE KEY UPDATE
        fingerprint = VALUES(fingerprint),
        output = VALUES(output),
        expires_at = VALUES(expires_at)"
            )),
            // The step back as text for the shared decoding (the column holds its UTF-8 bytes).
            entries: statement(format!(
                "SELECT CONVERT(step USING utf8mb4), output FROM {t}
    WHERE scope = ? AND `key` = ? AND fingerprint = ? AND expires_at > {NOW}"
            )),
            purge: statement(format!(
                "DELETE FROM {t} WHERE expires_at <= {NOW}
    ORDER BY expires_at, scope, `key`, step LIMIT ?"
            )),
            // Scope and key back as text for the shared decoding, as the step above.
            orphans: statement(format!(
                "SELECT CONVERT(j.scope USING utf8mb4), CONVERT(j.`key` USING utf8mb4),
        j.fingerprint, j.output FROM {t} j
    WHERE j.step = ? AND j.expires_at > {NOW}
    AND NOT EXISTS (SELECT 1 FROM {r} r
        WHERE r.scope = j.scope AND r.`key` = j.`key` AND r.expires_at > {NOW})
    AND NOT EXISTS (SELECT 1 FROM {t} f
        WHERE f.scope = j.scope AND f.`key` = j.`key` AND f.step = ?
        AND f.fingerprint = j.fingerprint AND f.expires_at > {NOW})
    LIMIT ?"
            )),
            table,
        }
    }
}

impl MySqlJournal {
    /// Creates the table (with its expiry index) if it does not exist; idempotent, like
    /// [`MySqlStore::migrate`].
    pub async fn migrate(&self) -> Result<(), StoreError> {
        sql::execute_each(self.pool(), self.schema_sql())
            .await
            .map_err(|e| sql::backend("mysql", e))
    }
}

impl Beside for MySqlStore {
    type Database = MySql;

    fn pool(&self) -> &sqlx::Pool<MySql> {
        MySqlStore::pool(self)
    }

    fn records(&self) -> &TableName {
        self.table()
    }
}
