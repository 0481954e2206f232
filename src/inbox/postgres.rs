//! The inbox on PostgreSQL: its statements and its `lock_timeout` claim.

use std::time::Duration;

use sqlx::{error::DatabaseError, PgConnection, Postgres};

use super::sql_inbox::{sealed::Dialect, SqlInbox};
use super::InboxError;
use crate::sql::{self, Query};

/// SQLSTATE `lock_not_available`: the lock timeout passed.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// The inbox table on PostgreSQL. Clones share the pool.
///
/// ```sql
/// CREATE TABLE IF NOT EXISTS tower_inbox (
///     consumer    TEXT COLLATE "C" NOT NULL,
///     message_id  TEXT COLLATE "C" NOT NULL,
///     received_at TIMESTAMPTZ      NOT NULL DEFAULT now(),
///     PRIMARY KEY (consumer, message_id)
/// );
/// -- handler failures per message (`received_at`: the latest), purged with the ids
/// CREATE TABLE IF NOT EXISTS tower_inbox_failures (
///     consumer    TEXT COLLATE "C" NOT NULL,
///     message_id  TEXT COLLATE "C" NOT NULL,
///     failures    BIGINT           NOT NULL,
///     received_at TIMESTAMPTZ      NOT NULL DEFAULT now(),
///     PRIMARY KEY (consumer, message_id)
/// );
/// ```
///
/// The id columns compare bytewise (`COLLATE "C"`), as message ids are opaque: the primary
/// key's order then never depends on the operating system's language rules, which can
/// change under an index across upgrades. A table made by an earlier version works the same.
pub type PgInbox = SqlInbox<Postgres>;

impl Dialect for Postgres {
    /// The `lock_timeout` setting for the claim, e.g. `100ms`.
    type Wait = String;

    fn default_wait() -> String {
        "100ms".to_owned()
    }

    fn schema(t: &str, index: &str, f: &str) -> Vec<String> {
        vec![format!(
            "CREATE TABLE IF NOT EXISTS {t} (
    consumer    TEXT COLLATE \"C\" NOT NULL,
    message_id  TEXT COLLATE \"C\" NOT NULL,
    received_at TIMESTAMPTZ      NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS {index} ON {t} (received_at);
CREATE TABLE IF NOT EXISTS {f} (
    consumer    TEXT COLLATE \"C\" NOT NULL,
    message_id  TEXT COLLATE \"C\" NOT NULL,
    failures    BIGINT           NOT NULL,
    received_at TIMESTAMPTZ      NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
"
        )]
    }

    fn count_failure(f: &str) -> String {
        format!(
            "INSERT INTO {f} AS f (consumer, message_id, failures) VALUES ($1, $2, 1)
                 ON CONFLICT (consumer, message_id)
                 DO UPDATE SET failures = f.failures + 1, received_at = now()
                 RETURNING failures"
        )
    }

    async fn run_count_failure(
        pool: &sqlx::PgPool,
        count: Query<Self>,
    ) -> Result<i64, sqlx::Error> {
        let row = count.fetch_one(pool).await?;
        sqlx::Row::try_get(&row, 0)
    }

    fn failures_of(f: &str) -> String {
        format!("SELECT failures FROM {f} WHERE consumer = $1 AND message_id = $2")
    }

    // One round trip: set the short lock timeout, insert, put the setting back. The target
    // lists run left to right: `setting` (the FROM) first, then the insert (the first read of
    // `claimed`), then the restore, so only the insert waits briefly.
    fn claim(t: &str) -> String {
        format!(
            "WITH setting AS MATERIALIZED (
                     SELECT current_setting('lock_timeout') AS previous,
                            set_config('lock_timeout', $3, true)),
                 claimed AS (
                     INSERT INTO {t} (consumer, message_id) SELECT $1, $2 FROM setting
                     ON CONFLICT DO NOTHING RETURNING 1)
                 SELECT EXISTS (SELECT 1 FROM claimed) AS inserted,
                        set_config('lock_timeout', previous, true)
                 FROM setting"
        )
    }

    fn purge(t: &str) -> String {
        format!(
            "DELETE FROM {t} WHERE ctid IN (
                     SELECT ctid FROM {t} WHERE received_at < now() - $1 * interval '1 millisecond'
                     LIMIT $2)"
        )
    }

    async fn insert<'c>(
        conn: &'c mut PgConnection,
        claim: Query<Self>,
        lock_timeout: &'c String,
    ) -> Result<bool, sqlx::Error> {
        let row = claim.bind(lock_timeout).fetch_one(conn).await?;
        sqlx::Row::try_get(&row, 0)
    }

    fn busy(error: &(dyn DatabaseError + 'static)) -> bool {
        error.code().as_deref() == Some(LOCK_NOT_AVAILABLE)
    }
}

impl PgInbox {
    /// How long a claim waits for another copy's transaction before answering
    /// [`InboxClaim::Busy`](super::InboxClaim::Busy) (default 100 ms; at least 1 ms, at most
    /// PostgreSQL's limit of `i32::MAX` ms, about 24 days).
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        let millis = timeout.as_millis().clamp(1, i32::MAX as u128);
        self.wait = format!("{millis}ms");
        self
    }

    /// Creates the tables if they do not exist (safe when several processes start at once).
    pub async fn migrate(&self) -> Result<(), InboxError> {
        sql::migrate_postgres(&self.pool, self.sql.table.as_str(), self.schema_sql()).await?;
        Ok(())
    }

    /// The DDL [`migrate`](Self::migrate) runs, for your own migrations.
    pub fn schema_sql(&self) -> &str {
        &self.sql.schema[0]
    }
}
