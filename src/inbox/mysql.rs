//! The inbox on MySQL / MariaDB: its statements and its `innodb_lock_wait_timeout` claim.

use sqlx::{
    error::DatabaseError,
    mysql::{MySqlConnection, MySqlDatabaseError},
    MySql,
};

use super::sql_inbox::{sealed::Dialect, SqlInbox};
use super::InboxError;
use crate::sql::{self, Query};

/// InnoDB's "Lock wait timeout exceeded".
const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;

/// The inbox table on MySQL or MariaDB. Clones share the pool.
///
/// A copy whose id another transaction holds waits `innodb_lock_wait_timeout` for it, set to
/// [`lock_wait`](Self::lock_wait) seconds for the claim alone (default 1, MySQL's minimum;
/// MariaDB also accepts 0, which answers [`InboxClaim::Busy`](super::InboxClaim::Busy) at
/// once). So a busy copy holds a pool connection at most that long, then gives it back.
///
/// ```sql
/// CREATE TABLE IF NOT EXISTS tower_inbox (
///     consumer    VARCHAR(191) NOT NULL,
///     message_id  VARCHAR(191) NOT NULL,
///     received_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
///     PRIMARY KEY (consumer, message_id),
///     INDEX (received_at)
/// ) ENGINE = InnoDB;
/// -- handler failures per message (`received_at`: the latest), purged with the ids
/// CREATE TABLE IF NOT EXISTS tower_inbox_failures (
///     consumer    VARCHAR(191) NOT NULL,
///     message_id  VARCHAR(191) NOT NULL,
///     failures    BIGINT       NOT NULL,
///     received_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
///     PRIMARY KEY (consumer, message_id)
/// ) ENGINE = InnoDB;
/// ```
pub type MySqlInbox = SqlInbox<MySql>;

impl Dialect for MySql {
    /// `innodb_lock_wait_timeout` for the claim, in seconds.
    type Wait = u32;

    fn default_wait() -> u32 {
        1
    }

    fn schema(t: &str, index: &str, f: &str) -> Vec<String> {
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (
    consumer    VARCHAR(191) NOT NULL,
    message_id  VARCHAR(191) NOT NULL,
    received_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (consumer, message_id),
    INDEX {index} (received_at)
) ENGINE = InnoDB"
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {f} (
    consumer    VARCHAR(191) NOT NULL,
    message_id  VARCHAR(191) NOT NULL,
    failures    BIGINT       NOT NULL,
    received_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (consumer, message_id)
) ENGINE = InnoDB"
            ),
        ]
    }

    // No RETURNING on MySQL: `LAST_INSERT_ID(expr)` hands the new count back in the
    // statement's own answer, one round trip.
    fn count_failure(f: &str) -> String {
        format!(
            "INSERT INTO {f} (consumer, message_id, failures) VALUES (?, ?, LAST_INSERT_ID(1))
                 ON DUPLICATE KEY UPDATE failures = LAST_INSERT_ID(failures + 1),
                                         received_at = CURRENT_TIMESTAMP(6)"
        )
    }

    async fn run_count_failure(
        pool: &sqlx::MySqlPool,
        count: Query<Self>,
    ) -> Result<i64, sqlx::Error> {
        let done = count.execute(pool).await?;
        Ok(i64::try_from(done.last_insert_id()).unwrap_or(i64::MAX))
    }

    fn failures_of(f: &str) -> String {
        format!("SELECT failures FROM {f} WHERE consumer = ? AND message_id = ?")
    }

    fn claim(t: &str) -> String {
        format!("INSERT IGNORE INTO {t} (consumer, message_id) VALUES (?, ?)")
    }

    fn purge(t: &str) -> String {
        format!(
            "DELETE FROM {t} WHERE received_at < TIMESTAMPADD(MICROSECOND, -?, CURRENT_TIMESTAMP(6))
                 ORDER BY received_at LIMIT ?"
        )
    }

    async fn insert<'c>(
        conn: &'c mut MySqlConnection,
        claim: Query<Self>,
        lock_wait_secs: &'c u32,
    ) -> Result<bool, sqlx::Error> {
        let previous: u64 = sqlx::query_scalar("SELECT @@SESSION.innodb_lock_wait_timeout")
            .fetch_one(&mut *conn)
            .await?;
        sqlx::query("SET SESSION innodb_lock_wait_timeout = ?")
            .bind(lock_wait_secs)
            .execute(&mut *conn)
            .await?;
        let claimed = claim.execute(&mut *conn).await;
        // Restored whatever happened: the session goes back to the pool afterwards.
        sqlx::query("SET SESSION innodb_lock_wait_timeout = ?")
            .bind(previous)
            .execute(&mut *conn)
            .await?;
        Ok(claimed?.rows_affected() == 1)
    }

    fn busy(error: &(dyn DatabaseError + 'static)) -> bool {
        error
            .try_downcast_ref::<MySqlDatabaseError>()
            .is_some_and(|e| e.number() == ER_LOCK_WAIT_TIMEOUT)
    }
}

impl MySqlInbox {
    /// Seconds a claim waits for another copy's transaction (default 1).
    pub fn lock_wait(mut self, seconds: u32) -> Self {
        self.wait = seconds;
        self
    }

    /// Creates the tables if they do not exist.
    pub async fn migrate(&self) -> Result<(), InboxError> {
        sql::execute_each(&self.pool, &self.sql.schema).await?;
        Ok(())
    }

    /// The DDL [`migrate`](Self::migrate) runs, one statement per item, for your own
    /// migrations.
    pub fn schema_sql(&self) -> &[String] {
        &self.sql.schema
    }
}
