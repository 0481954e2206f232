//! The outbox on MySQL 8 / MariaDB 10.6+ (both have `FOR UPDATE SKIP LOCKED`): its statements.

use sqlx::MySql;

use super::sql_outbox::{sealed::Dialect, SqlOutbox, Statements};
use super::OutboxError;
use crate::sql::{self, statement, AddedColumn, TableName};

/// The outbox table on MySQL or MariaDB. Clones share the pool. Relays poll (MySQL has no
/// `LISTEN`); set [`RelayConfig::poll_interval`](super::RelayConfig::poll_interval) to the
/// latency you accept.
///
/// ```sql
/// CREATE TABLE IF NOT EXISTS tower_outbox (
///     seq        BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
///     id         VARCHAR(64)  NOT NULL UNIQUE,
///     topic      VARCHAR(255) NOT NULL,
///     payload    LONGBLOB     NOT NULL,
///     created_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
///     sent_at    DATETIME(6)  NULL,
///     ordering_key VARCHAR(255) NULL,
///     attempts   BIGINT       NOT NULL DEFAULT 0,
///     last_error TEXT         NULL,
///     next_attempt_at DATETIME(6) NULL,
///     parked_at  DATETIME(6)  NULL,
///     INDEX (sent_at, seq)
/// ) ENGINE = InnoDB;
/// ```
pub type MySqlOutbox = SqlOutbox<MySql>;

impl Dialect for MySql {
    // READ COMMITTED for the relay's one transaction: under InnoDB's default REPEATABLE READ
    // the locking read also locks the gaps of the (sent_at, seq) index, which blocks the
    // producers' inserts of new unsent rows and deadlocks with them (1213).
    const RELAY_SETUP: Option<&'static str> =
        Some("SET TRANSACTION ISOLATION LEVEL READ COMMITTED");

    fn statements(table: TableName) -> Statements {
        let t = table.as_str();
        let index = table.derived("unsent_idx");
        Statements {
            schema: vec![format!(
                "CREATE TABLE IF NOT EXISTS {t} (
    seq        BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    id         VARCHAR(64)  NOT NULL UNIQUE,
    topic      VARCHAR(255) NOT NULL,
    payload    LONGBLOB     NOT NULL,
    created_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    sent_at    DATETIME(6)  NULL,
    ordering_key VARCHAR(255) NULL,
    attempts   BIGINT       NOT NULL DEFAULT 0,
    last_error TEXT         NULL,
    next_attempt_at DATETIME(6) NULL,
    parked_at  DATETIME(6)  NULL,
    INDEX {index} (sent_at, seq)
) ENGINE = InnoDB"
            )],
            enqueue: statement(format!(
                "INSERT INTO {t} (id, topic, payload, ordering_key) VALUES (?, ?, ?, ?)"
            )),
            channel: None,
            take: statement(format!(
                "SELECT seq, id, topic, payload, ordering_key, attempts FROM {t}
                 WHERE sent_at IS NULL AND parked_at IS NULL
                   AND (next_attempt_at IS NULL OR next_attempt_at <= CURRENT_TIMESTAMP(6))
                 ORDER BY seq LIMIT ? FOR UPDATE SKIP LOCKED"
            )),
            // Followed by `(?, ?, ...)`, one placeholder per row.
            mark: statement(format!(
                "UPDATE {t} SET sent_at = CURRENT_TIMESTAMP(6) WHERE seq IN "
            )),
            release: None,
            retry_later: statement(format!(
                "UPDATE {t} SET attempts = attempts + 1, last_error = ?,
                     next_attempt_at = TIMESTAMPADD(MICROSECOND, ?, CURRENT_TIMESTAMP(6))
                 WHERE seq = ?"
            )),
            park: statement(format!(
                "UPDATE {t} SET attempts = attempts + 1, last_error = ?,
                     parked_at = CURRENT_TIMESTAMP(6)
                 WHERE seq = ?"
            )),
            purge: statement(format!(
                "DELETE FROM {t} WHERE sent_at < TIMESTAMPADD(MICROSECOND, -?, CURRENT_TIMESTAMP(6))
                 ORDER BY sent_at LIMIT ?"
            )),
            unsent: Statements::unsent(&table),
            parked: Statements::parked(&table, |_| "?".into()),
            upgrades: [AddedColumn {
                name: "ordering_key",
                add: format!("ALTER TABLE {t} ADD COLUMN ordering_key VARCHAR(255) NULL"),
            }]
            .into_iter()
            .chain(Statements::refusal_columns(&table, "", "DATETIME(6) NULL"))
            .collect(),
            table,
        }
    }
}

impl MySqlOutbox {
    /// Creates the table if it does not exist. Never touches `_sqlx_migrations`.
    pub async fn migrate(&self) -> Result<(), OutboxError> {
        sql::execute_each(&self.pool, &self.sql.schema).await?;
        sql::add_columns(&self.pool, self.sql.table.as_str(), &self.sql.upgrades).await?;
        Ok(())
    }

    /// The DDL [`migrate`](Self::migrate) runs, for your own migrations.
    pub fn schema_sql(&self) -> &str {
        &self.sql.schema[0]
    }
}
