//! The one inbox code path: [`SqlInbox`] runs a table of statements each database renders
//! once (its own file: `postgres.rs`, `mysql.rs`, `sqlite.rs`), as
//! [`SqlOutbox`](crate::outbox::SqlOutbox) does for the outbox.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use sqlx::{Pool, SqlStr};

use super::{InboxClaim, InboxError, InboxStore, DEFAULT_TABLE};
use crate::sql::{statement, TableName};

/// The inbox table on one database; use it by its names [`PgInbox`](super::PgInbox),
/// [`MySqlInbox`](super::MySqlInbox) and [`SqliteInbox`](super::SqliteInbox). Clones share
/// the pool.
pub struct SqlInbox<DB: InboxDatabase> {
    pub(super) pool: Pool<DB>,
    pub(super) sql: Arc<Statements>,
    /// How long a claim waits for another copy's transaction, as the dialect binds it.
    pub(super) wait: DB::Wait,
}

/// A database [`SqlInbox`] runs on: PostgreSQL, MySQL / MariaDB, SQLite. Implemented by this
/// crate only.
pub trait InboxDatabase: sealed::Dialect {}

impl<DB: sealed::Dialect> InboxDatabase for DB {}

pub(crate) mod sealed {
    use std::future::Future;

    use sqlx::error::DatabaseError;

    use crate::sql::{OwnTable, Query};

    /// What differs between databases: the SQL text, how the claim waits for another copy,
    /// and which error means it waited too long.
    pub trait Dialect: OwnTable {
        /// The claim's wait for another copy's transaction, in the form the claim uses it
        /// (PostgreSQL: a `lock_timeout` text; MySQL: seconds; SQLite: none, as sqlx's busy
        /// timeout decides).
        type Wait: Clone + Send + Sync + 'static;

        /// The wait of a new inbox.
        fn default_wait() -> Self::Wait;

        /// The DDL for table `t`, its index `index` and its failure table `f`, one item per
        /// statement `migrate` sends (PostgreSQL has one).
        fn schema(t: &str, index: &str, f: &str) -> Vec<String>;

        /// Adds one handler failure of `consumer, message_id` to the failure table `f`.
        fn count_failure(f: &str) -> String;

        /// Runs `count_failure` (`consumer, message_id` bound): the failures counted now.
        fn run_count_failure<'c>(
            pool: &'c sqlx::Pool<Self>,
            count: Query<Self>,
        ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'c;

        /// The failures counted for `consumer, message_id` in `f` (no row: none).
        fn failures_of(f: &str) -> String;

        /// The claim on `t`: inserts `consumer, message_id` unless the pair is there.
        fn claim(t: &str) -> String;

        /// The purge of `t`: deletes ids older than an age, at most a limit of them
        /// (run by `OwnTable::run_purge`).
        fn purge(t: &str) -> String;

        /// Runs `claim` (`consumer, message_id` bound) on `conn` under `wait`: whether it
        /// inserted the id (`false`: a committed copy has it).
        fn insert<'c>(
            conn: &'c mut Self::Connection,
            claim: Query<Self>,
            wait: &'c Self::Wait,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'c;

        /// Whether `error` means that another copy holds the claim right now.
        fn busy(error: &(dyn DatabaseError + 'static)) -> bool;
    }
}

/// The statements of one inbox table, rendered once by its database's [`sealed::Dialect`].
pub(super) struct Statements {
    /// The table; PostgreSQL's `migrate` takes its advisory lock on the name.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) table: TableName,
    /// The DDL, one item per statement `migrate` sends (PostgreSQL has one).
    pub(crate) schema: Vec<String>,
    /// Adds one handler failure of a message; returns the count.
    pub(crate) count_failure: SqlStr,
    /// Reads the handler failures of a message.
    pub(crate) failures_of: SqlStr,
    /// Deletes failure counts older than an age, at most a limit of them.
    pub(crate) purge_failures: SqlStr,
    /// Inserts `consumer, message_id` unless the pair is there; how it is bound and run is
    /// the dialect's `insert`.
    pub(crate) claim: SqlStr,
    /// Deletes ids older than an age, at most a limit of them.
    pub(crate) purge: SqlStr,
}

impl Statements {
    fn render<DB: InboxDatabase>(table: TableName) -> Self {
        let t = table.as_str();
        // The failure table lives beside the inbox table, in its schema or database.
        let f = match t.rsplit_once('.') {
            Some((qualifier, _)) => format!("{qualifier}.{}", table.derived("failures")),
            None => table.derived("failures"),
        };
        Self {
            schema: DB::schema(t, &table.derived("received_at_idx"), &f),
            claim: statement(DB::claim(t)),
            purge: statement(DB::purge(t)),
            count_failure: statement(DB::count_failure(&f)),
            failures_of: statement(DB::failures_of(&f)),
            purge_failures: statement(DB::purge(&f)),
            table,
        }
    }
}

impl<DB: InboxDatabase> Clone for SqlInbox<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            sql: Arc::clone(&self.sql),
            wait: self.wait.clone(),
        }
    }
}

impl<DB: InboxDatabase> SqlInbox<DB> {
    /// The inbox in table `tower_inbox`, with the database's default wait for claims
    /// (PostgreSQL: a 100 ms lock timeout; MySQL: a 1 s lock wait).
    pub fn new(pool: Pool<DB>) -> Self {
        Self::with_table(pool, DEFAULT_TABLE).expect("the default table name is valid")
    }

    /// The inbox in another table (optionally qualified: `schema.table` on PostgreSQL,
    /// `database.table` on MySQL).
    pub fn with_table(pool: Pool<DB>, table: &str) -> Result<Self, InboxError> {
        let sql = Statements::render::<DB>(TableName::new(table)?);
        Ok(Self {
            pool,
            sql: Arc::new(sql),
            wait: DB::default_wait(),
        })
    }
}

#[async_trait]
impl<DB> InboxStore for SqlInbox<DB>
where
    DB: InboxDatabase,
    for<'a> &'a str: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'r> i64: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    DB::Arguments: sqlx::IntoArguments<DB>,
{
    type Database = DB;

    fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    async fn claim(
        &self,
        conn: &mut DB::Connection,
        consumer: &str,
        message_id: &str,
    ) -> Result<InboxClaim, InboxError> {
        let claim = sqlx::query(self.sql.claim.clone())
            .bind(consumer)
            .bind(message_id);
        match DB::insert(conn, claim, &self.wait).await {
            Ok(true) => Ok(InboxClaim::New),
            Ok(false) => Ok(InboxClaim::Duplicate),
            // On PostgreSQL the whole statement failed and the transaction is aborted; the
            // consumer rolls it back either way.
            Err(sqlx::Error::Database(error)) if DB::busy(&*error) => Ok(InboxClaim::Busy),
            Err(error) => Err(error.into()),
        }
    }

    async fn purge(&self, retention: Duration, limit: u32) -> Result<u64, InboxError> {
        let mut purged = 0;
        for purge in [&self.sql.purge, &self.sql.purge_failures] {
            let query = sqlx::query(purge.clone());
            purged += DB::run_purge(&self.pool, query, retention, limit.max(1)).await?;
        }
        Ok(purged)
    }

    async fn count_failure(&self, consumer: &str, message_id: &str) -> Result<u32, InboxError> {
        let count = sqlx::query(self.sql.count_failure.clone())
            .bind(consumer)
            .bind(message_id);
        let failures = DB::run_count_failure(&self.pool, count).await?;
        Ok(u32::try_from(failures).unwrap_or(u32::MAX))
    }

    async fn failures(
        &self,
        conn: &mut DB::Connection,
        consumer: &str,
        message_id: &str,
    ) -> Result<u32, InboxError> {
        let row = sqlx::query(self.sql.failures_of.clone())
            .bind(consumer)
            .bind(message_id)
            .fetch_optional(conn)
            .await?;
        let failures: i64 = match row {
            Some(row) => sqlx::Row::try_get(&row, 0)?,
            None => 0,
        };
        Ok(u32::try_from(failures).unwrap_or(u32::MAX))
    }
}
