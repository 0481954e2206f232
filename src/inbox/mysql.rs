//! The inbox on MySQL / MariaDB.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use sqlx::SqlStr;
use sqlx::{mysql::MySqlDatabaseError, MySql, MySqlConnection, MySqlPool};

use super::{InboxClaim, InboxError, InboxStore, DEFAULT_TABLE};
use crate::sql::{statement, TableName};

/// InnoDB's "Lock wait timeout exceeded".
const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;

/// The inbox table on MySQL or MariaDB. Clones share the pool.
///
/// A copy whose id another transaction holds waits `innodb_lock_wait_timeout` for it, set to
/// [`lock_wait`](Self::lock_wait) seconds for the claim alone (default 1, MySQL's minimum;
/// MariaDB also accepts 0, which answers [`InboxClaim::Busy`] at once). So a busy copy holds a
/// pool connection at most that long, then gives it back.
///
/// ```sql
/// CREATE TABLE IF NOT EXISTS tower_inbox (
///     consumer    VARCHAR(191) NOT NULL,
///     message_id  VARCHAR(191) NOT NULL,
///     received_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
///     PRIMARY KEY (consumer, message_id),
///     INDEX (received_at)
/// ) ENGINE = InnoDB;
/// ```
#[derive(Clone)]
pub struct MySqlInbox {
    pool: MySqlPool,
    lock_wait_secs: u32,
    sql: Arc<Statements>,
}

struct Statements {
    schema: String,
    claim: SqlStr,
    purge: SqlStr,
}

impl MySqlInbox {
    /// The inbox in table `tower_inbox`.
    pub fn new(pool: MySqlPool) -> Self {
        Self::with_table(pool, DEFAULT_TABLE).expect("the default table name is valid")
    }

    /// The inbox in another table (optionally `database.table`).
    pub fn with_table(pool: MySqlPool, table: &str) -> Result<Self, InboxError> {
        let table = TableName::new(table)?;
        let t = table.as_str();
        let index = table.derived("received_at_idx");
        let sql = Statements {
            schema: format!(
                "CREATE TABLE IF NOT EXISTS {t} (
    consumer    VARCHAR(191) NOT NULL,
    message_id  VARCHAR(191) NOT NULL,
    received_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (consumer, message_id),
    INDEX {index} (received_at)
) ENGINE = InnoDB"
            ),
            claim: statement(format!("INSERT IGNORE INTO {t} (consumer, message_id) VALUES (?, ?)")),
            purge: statement(format!(
                "DELETE FROM {t} WHERE received_at < TIMESTAMPADD(MICROSECOND, -?, CURRENT_TIMESTAMP(6))
                 ORDER BY received_at LIMIT ?"
            )),
        };
        Ok(Self {
            pool,
            lock_wait_secs: 1,
            sql: Arc::new(sql),
        })
    }

    /// Seconds a claim waits for another copy's transaction (default 1).
    pub fn lock_wait(mut self, seconds: u32) -> Self {
        self.lock_wait_secs = seconds;
        self
    }

    /// Creates the table if it does not exist.
    pub async fn migrate(&self) -> Result<(), InboxError> {
        sqlx::query(sqlx::AssertSqlSafe(self.sql.schema.as_str()))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The DDL [`migrate`](Self::migrate) runs, for your own migrations.
    pub fn schema_sql(&self) -> &str {
        &self.sql.schema
    }
}

#[async_trait]
impl InboxStore for MySqlInbox {
    type Database = MySql;

    fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    async fn claim(
        &self,
        conn: &mut MySqlConnection,
        consumer: &str,
        message_id: &str,
    ) -> Result<InboxClaim, InboxError> {
        let previous: u64 = sqlx::query_scalar("SELECT @@SESSION.innodb_lock_wait_timeout")
            .fetch_one(&mut *conn)
            .await?;
        sqlx::query("SET SESSION innodb_lock_wait_timeout = ?")
            .bind(self.lock_wait_secs)
            .execute(&mut *conn)
            .await?;
        let claimed = sqlx::query(self.sql.claim.clone())
            .bind(consumer)
            .bind(message_id)
            .execute(&mut *conn)
            .await;
        // Restored whatever happened: the session goes back to the pool afterwards.
        sqlx::query("SET SESSION innodb_lock_wait_timeout = ?")
            .bind(previous)
            .execute(&mut *conn)
            .await?;
        match claimed {
            Ok(done) if done.rows_affected() == 1 => Ok(InboxClaim::New),
            Ok(_) => Ok(InboxClaim::Duplicate),
            Err(sqlx::Error::Database(error))
                if error
                    .try_downcast_ref::<MySqlDatabaseError>()
                    .is_some_and(|e| e.number() == ER_LOCK_WAIT_TIMEOUT) =>
            {
                Ok(InboxClaim::Busy)
            }
            Err(error) => Err(error.into()),
        }
    }

    async fn purge(&self, retention: Duration, limit: u32) -> Result<u64, InboxError> {
        let micros = i64::try_from(retention.as_micros()).unwrap_or(i64::MAX);
        let done = sqlx::query(self.sql.purge.clone())
            .bind(micros)
            .bind(limit.max(1))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }
}
