//! The PostgreSQL store (feature `postgres`), on a sqlx [`PgPool`]. The schema, how a claim
//! works and purging are documented on [`PostgresStore`].

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;
use bytes::Bytes;
use sqlx::SqlStr;
use sqlx::{PgPool, Row};

use super::{
    keep_listening, pg_notify, sql_builder::sealed::Assemble, Completions, Feed, SqlStore,
    SqlStoreBuilder, Store, StoreError,
};
use crate::record::{ClaimOutcome, Fingerprint, Record, StoreKey, Token};
use crate::sql::{self, statement, TableName};

const BACKEND: &str = "postgres";

/// How often a claim re-runs after an empty answer. Each empty answer means another
/// transaction changed this very key between our snapshot and our insert, so running out of
/// attempts takes a storm of claims and releases on one key.
const CLAIM_ATTEMPTS: usize = 8;

/// A PostgreSQL [`Store`]. Clones share the pool and the prepared SQL text.
///
/// ```no_run
/// use tower_idempotency::store::PostgresStore;
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://app@localhost/app").await?;
/// let store = PostgresStore::new(pool);
/// store.migrate().await?;
/// # Ok(())
/// # }
/// ```
///
/// # Schema
///
/// [`PostgresStore::migrate`] creates it for you (idempotently, and safely when several
/// processes start at once). If you run your own migrations instead, this is the DDL for the
/// default table name ([`PostgresStore::schema_sql`] gives it for any table name):
///
/// ```sql
/// CREATE TABLE IF NOT EXISTS tower_idempotency_records (
///     scope       TEXT COLLATE "C" NOT NULL,
///     key         TEXT COLLATE "C" NOT NULL,
///     fingerprint BYTEA            NOT NULL,
///     token       BYTEA,
///     payload     BYTEA,
///     expires_at  TIMESTAMPTZ      NOT NULL,
///     PRIMARY KEY (scope, key),
///     CHECK ((token IS NULL) <> (payload IS NULL))
/// );
/// CREATE INDEX IF NOT EXISTS tower_idempotency_records_expires_at_idx
///     ON tower_idempotency_records (expires_at);
/// ```
///
/// A row in progress has a `token` and no `payload`, and `expires_at` is the end of its lease;
/// a completed row has a `payload` and no `token`, and `expires_at` is the end of its
/// retention. A row whose `expires_at` has passed counts as absent.
///
/// `scope` and `key` compare bytewise (`COLLATE "C"`): keys are opaque and equality is all
/// the store asks of them, so the primary key's order must not depend on the language rules
/// of the operating system's C library, whose changes across upgrades (glibc 2.28) leave
/// indexes on text out of order until they are rebuilt. A table made by an earlier version
/// works the same; `ALTER TABLE tower_idempotency_records ALTER COLUMN scope TYPE TEXT
/// COLLATE "C", ALTER COLUMN key TYPE TEXT COLLATE "C"` (which rebuilds the index) moves it.
///
/// # How a claim works
///
/// A claim is one statement, hence one round trip and one atomic decision:
///
/// - it first reads the live row under its statement snapshot; when there is one (the common
///   case of a replay) it returns it without writing or locking anything;
/// - otherwise it runs `INSERT .. ON CONFLICT (scope, key) DO UPDATE .. WHERE <row expired>`,
///   which inserts a new claim or takes over an expired one. The unique index and the row lock
///   of `ON CONFLICT` referee concurrent claims, never the read.
///
/// If a concurrent transaction commits the row between the snapshot and the insert, the
/// insert yields nothing and the snapshot shows nothing: the statement answers with no row at
/// all and the claim runs again with a fresh snapshot (rare; only under contention on a key).
///
/// Every time — lease ends, retention ends, purges — is measured by the database's clock
/// (`now()`), never the application's.
///
/// # Completion notifications
///
/// Off by default. With [`PostgresStoreBuilder::completion_notifications`], `complete` and
/// `release` `NOTIFY` a channel named after the table with the key's digest, from the same
/// statement (no extra round trip), and each store value (with its clones) keeps one
/// connection (besides its pool) `LISTEN`ing once an engine on it starts, so a duplicate
/// waiting in another process is woken when the original finishes instead of at its next poll
/// (see [`Store::completions`]). The price: PostgreSQL serialises the commits of notifying
/// transactions, which measured at less than half the rate of new keys per second under
/// concurrency (BENCHMARKS.md). The transactional mode never notifies: its duplicates wait on
/// the owner's lock.
///
/// # Purging
///
/// Expired rows are harmless (they count as absent and a claim overwrites them) but take
/// space. Call [`Store::purge_expired`] from your own scheduler, or let
/// [`spawn_purger`](super::spawn_purger) do it in the background.
#[derive(Clone)]
pub struct PostgresStore {
    pool: PgPool,
    sql: Arc<Statements>,
    feed: Arc<Feed>,
}

/// Builds a [`PostgresStore`] with a table name other than the default.
///
/// ```no_run
/// use tower_idempotency::store::PostgresStore;
///
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::builder(pool)
///     .table("billing.idempotency_keys")
///     .build()?;
/// # Ok(())
/// # }
/// ```
pub type PostgresStoreBuilder = SqlStoreBuilder<PostgresStore>;

/// The statements for one table. Table names cannot be bound as parameters, so the text is
/// built once from a validated [`TableName`]; sqlx then prepares each once per connection.
struct Statements {
    table: TableName,
    /// The channel notified of completions and releases, if they notify.
    channel: Option<String>,
    schema: String,
    claim: SqlStr,
    renew: SqlStr,
    complete: SqlStr,
    release: SqlStr,
    lookup: SqlStr,
    forget: SqlStr,
    purge: SqlStr,
}

impl Statements {
    fn new(table: TableName, notify: bool) -> Self {
        let t = table.as_str();
        let channel = notify.then(|| pg_notify::channel(&table));
        let index = table.derived("expires_at_idx");
        // The CHECK makes a row that is both (or neither) in progress and completed
        // impossible, so `payload IS NULL` alone can tell the two states apart.
        let schema = format!(
            "CREATE TABLE IF NOT EXISTS {t} (
    scope       TEXT COLLATE \"C\" NOT NULL,
    key         TEXT COLLATE \"C\" NOT NULL,
    fingerprint BYTEA            NOT NULL,
    token       BYTEA,
    payload     BYTEA,
    expires_at  TIMESTAMPTZ      NOT NULL,
    PRIMARY KEY (scope, key),
    CHECK ((token IS NULL) <> (payload IS NULL))
);
CREATE INDEX IF NOT EXISTS {index}
    ON {t} (expires_at);
"
        );
        // `live` and `claimed` run against the same snapshot. `live` only spares the replay
        // path a write and a row lock; the decision is `claimed`'s: a unique-index insert, or
        // an update under the row lock whose WHERE sees the latest committed version of the
        // row. `DO UPDATE` needs that WHERE: without it every duplicate would write a row.
        let claim = format!(
            "WITH live AS (
    SELECT fingerprint, payload FROM {t}
    WHERE scope = $1 AND key = $2 AND expires_at > now()
), claimed AS (
    INSERT INTO {t} AS r (scope, key, fingerprint, token, payload, expires_at)
    SELECT $1, $2, $3, $4, NULL, now() + $5 * interval '1 millisecond'
    WHERE NOT EXISTS (SELECT 1 FROM live)
    ON CONFLICT (scope, key) DO UPDATE
        SET fingerprint = excluded.fingerprint,
            token = excluded.token,
            payload = NULL,
            expires_at = excluded.expires_at
        WHERE r.expires_at <= now()
    RETURNING 1
)
SELECT true AS claimed, NULL::bytea AS fingerprint, NULL::bytea AS payload FROM claimed
UNION ALL
SELECT false, fingerprint, payload FROM live"
        );
        // The fence: only the live claim holding exactly this token. Completed rows have no
        // token, so they never match.
        let fence = "scope = $1 AND key = $2 AND token = $3 AND expires_at > now()";
        let renew = format!(
            "UPDATE {t} SET expires_at = now() + $4 * interval '1 millisecond' WHERE {fence}"
        );
        let complete = format!(
            "UPDATE {t}
    SET token = NULL, payload = $4, expires_at = now() + $5 * interval '1 millisecond'
    WHERE {fence}"
        );
        let release = format!("DELETE FROM {t} WHERE {fence}");
        let (complete, release) = match &channel {
            Some(channel) => (
                pg_notify::notifying(&complete, channel, 6),
                pg_notify::notifying(&release, channel, 4),
            ),
            None => (complete, release),
        };
        let lookup = format!(
            "SELECT fingerprint, payload FROM {t}
    WHERE scope = $1 AND key = $2 AND expires_at > now()"
        );
        let forget = format!("DELETE FROM {t} WHERE scope = $1 AND key = $2");
        // SKIP LOCKED lets concurrent purgers (one per process) split the work instead of
        // queueing, and leaves alone a row a claim is taking over right now. The outer
        // expiry test re-checks the row version actually deleted, so a row taken over after
        // the inner scan picked it is never deleted.
        let purge = format!(
            "DELETE FROM {t}
    WHERE ctid IN (
        SELECT ctid FROM {t} WHERE expires_at <= now() LIMIT $1 FOR UPDATE SKIP LOCKED
    )
    AND expires_at <= now()"
        );
        Self {
            table,
            channel,
            schema,
            claim: statement(claim),
            renew: statement(renew),
            complete: statement(complete),
            release: statement(release),
            lookup: statement(lookup),
            forget: statement(forget),
            purge: statement(purge),
        }
    }
}

impl PostgresStore {
    /// The table used unless [`SqlStoreBuilder::table`] says otherwise.
    ///
    /// ```
    /// # use tower_idempotency::store::PostgresStore;
    /// assert_eq!(PostgresStore::DEFAULT_TABLE, "tower_idempotency_records");
    /// ```
    pub const DEFAULT_TABLE: &'static str = "tower_idempotency_records";

    /// A store on `pool` using the default table, [`DEFAULT_TABLE`](Self::DEFAULT_TABLE).
    /// Run [`migrate`](Self::migrate) once (or your own migration) before using it.
    ///
    /// ```no_run
    /// # use tower_idempotency::store::PostgresStore;
    /// # async fn example() -> Result<(), sqlx::Error> {
    /// let pool = sqlx::postgres::PgPoolOptions::new()
    ///     .max_connections(16)
    ///     .connect("postgres://app@localhost/app")
    ///     .await?;
    /// let store = PostgresStore::new(pool);
    /// # Ok(())
    /// # }
    /// ```
    pub fn new(pool: PgPool) -> Self {
        Self::assemble(pool, default_table(), false)
    }

    /// A builder, to choose the table name.
    ///
    /// ```no_run
    /// # use tower_idempotency::store::PostgresStore;
    /// # fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let store = PostgresStore::builder(pool).table("idempotency").build()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(pool: PgPool) -> PostgresStoreBuilder {
        SqlStoreBuilder::new(pool)
    }

    /// The table this store uses.
    ///
    /// ```no_run
    /// # use tower_idempotency::store::PostgresStore;
    /// # fn example(pool: sqlx::PgPool) {
    /// let store = PostgresStore::new(pool);
    /// assert_eq!(store.table().as_str(), "tower_idempotency_records");
    /// # }
    /// ```
    pub fn table(&self) -> &TableName {
        &self.sql.table
    }

    /// The pool the store runs on.
    ///
    /// ```no_run
    /// # use tower_idempotency::store::PostgresStore;
    /// # fn example(store: PostgresStore) {
    /// println!("{} connections open", store.pool().size());
    /// # }
    /// ```
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The DDL that [`migrate`](Self::migrate) runs for this store's table: a `CREATE TABLE`
    /// and a `CREATE INDEX` on the expiry column, both `IF NOT EXISTS`. Paste it into your own
    /// migrations if you prefer to run those.
    ///
    /// ```no_run
    /// # use tower_idempotency::store::PostgresStore;
    /// # fn example(pool: sqlx::PgPool) {
    /// let store = PostgresStore::new(pool);
    /// std::fs::write("migrations/0042_idempotency.sql", store.schema_sql()).unwrap();
    /// # }
    /// ```
    pub fn schema_sql(&self) -> &str {
        &self.sql.schema
    }

    /// Creates the table and its index if they do not exist yet.
    ///
    /// Safe to call on every start, from many processes at once: a transaction-scoped advisory
    /// lock serialises the callers, because concurrent `CREATE TABLE IF NOT EXISTS` can still
    /// fail on PostgreSQL's catalog constraints. It does not touch sqlx's own
    /// `_sqlx_migrations` table, so it never interferes with your migrations. A schema in a
    /// qualified table name (`schema.table`) must already exist.
    ///
    /// ```no_run
    /// # use tower_idempotency::store::PostgresStore;
    /// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let store = PostgresStore::new(pool);
    /// store.migrate().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn migrate(&self) -> Result<(), StoreError> {
        sql::migrate_postgres(&self.pool, self.sql.table.as_str(), &self.sql.schema)
            .await
            .map_err(backend)
    }
}

impl SqlStore for PostgresStore {}

impl Assemble for PostgresStore {
    type Pool = PgPool;
    /// Whether completions notify waiters in other processes.
    type Options = bool;
    const DEFAULT_TABLE: &'static str = Self::DEFAULT_TABLE;

    fn assemble(pool: PgPool, table: TableName, notify: bool) -> Self {
        Self {
            pool,
            sql: Arc::new(Statements::new(table, notify)),
            feed: Arc::default(),
        }
    }
}

impl PostgresStoreBuilder {
    /// Whether `complete` and `release` notify waiters in other processes (default off; see
    /// [`Store::completions`]): the settling statement itself calls `pg_notify` on a channel
    /// named after the table, and each store keeps one extra connection `LISTEN`ing. Turn it
    /// on when duplicates across processes must be answered within a millisecond; it costs
    /// commit parallelism, since PostgreSQL serialises the commits of notifying transactions.
    /// Off, waiters in other processes poll (5 ms doubling to 250 ms).
    pub fn completion_notifications(mut self, on: bool) -> Self {
        *self.options_mut() = on;
        self
    }
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.sql.table)
            .field("pool", &self.pool)
            .finish()
    }
}

impl PostgresStore {
    /// A connection for one operation, closed rather than reused if the operation finds
    /// its server read-only (a standby, or a primary demoted by a failover).
    async fn connection(&self) -> Result<sql::Checked<sqlx::Postgres>, StoreError> {
        sql::Checked::acquire(&self.pool, BACKEND).await
    }
}

fn default_table() -> TableName {
    TableName::new(PostgresStore::DEFAULT_TABLE).expect("the default table name is valid")
}

fn backend(error: sqlx::Error) -> StoreError {
    sql::backend(BACKEND, error)
}

fn record_from_row(row: &sqlx::postgres::PgRow) -> Result<Record, StoreError> {
    let fingerprint: Vec<u8> = row.try_get("fingerprint").map_err(backend)?;
    let payload: Option<Vec<u8>> = row.try_get("payload").map_err(backend)?;
    sql::decode_record(BACKEND, &fingerprint, payload)
}

#[async_trait]
impl Store for PostgresStore {
    async fn claim(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        let lease = sql::millis(lease)?;
        let mut conn = self.connection().await?;
        for attempt in 1..=CLAIM_ATTEMPTS {
            // A fresh token per attempt: a token must never be reused across claims.
            let token = Token::random();
            let row = sqlx::query(self.sql.claim.clone())
                .bind(key.scope())
                .bind(key.key())
                .bind(fingerprint.as_bytes().as_slice())
                .bind(token.to_bytes().as_slice())
                .bind(lease)
                .fetch_optional(&mut *conn)
                .await
                .map_err(backend);
            let Some(row) = conn.check(row)? else {
                tracing::trace!(key = %key.log_id(), attempt, "claim raced a concurrent change, retrying");
                continue;
            };
            return if row.try_get::<bool, _>("claimed").map_err(backend)? {
                Ok(ClaimOutcome::Claimed(token))
            } else {
                record_from_row(&row).map(ClaimOutcome::Existing)
            };
        }
        Err(StoreError::backend(
            BACKEND,
            format!(
                "claim found the key changed by concurrent transactions {CLAIM_ATTEMPTS} times in a row"
            ),
        ))
    }

    async fn renew(&self, key: &StoreKey, token: Token, lease: Duration) -> Result<(), StoreError> {
        let lease = sql::millis(lease)?;
        let mut conn = self.connection().await?;
        let done = sqlx::query(self.sql.renew.clone())
            .bind(key.scope())
            .bind(key.key())
            .bind(token.to_bytes().as_slice())
            .bind(lease)
            .execute(&mut *conn)
            .await
            .map_err(backend);
        let done = conn.check(done)?;
        sql::fenced(done.rows_affected())
    }

    async fn complete(
        &self,
        key: &StoreKey,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let token = token.to_bytes();
        let retention = sql::millis(retention)?;
        let mut conn = self.connection().await?;
        let query = sqlx::query(self.sql.complete.clone())
            .bind(key.scope())
            .bind(key.key())
            .bind(token.as_slice())
            .bind(payload.as_ref())
            .bind(retention);
        let done = pg_notify::bind_payload(query, key, self.sql.channel.is_some())
            .execute(&mut *conn)
            .await
            .map_err(backend);
        let done = conn.check(done)?;
        sql::fenced(done.rows_affected())
    }

    async fn release(&self, key: &StoreKey, token: Token) -> Result<(), StoreError> {
        let token = token.to_bytes();
        let mut conn = self.connection().await?;
        let query = sqlx::query(self.sql.release.clone())
            .bind(key.scope())
            .bind(key.key())
            .bind(token.as_slice());
        let done = pg_notify::bind_payload(query, key, self.sql.channel.is_some())
            .execute(&mut *conn)
            .await
            .map_err(backend);
        let done = conn.check(done)?;
        sql::fenced(done.rows_affected())
    }

    async fn lookup(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        let row = sqlx::query(self.sql.lookup.clone())
            .bind(key.scope())
            .bind(key.key())
            .fetch_optional(&self.pool)
            .await
            .map_err(backend)?;
        row.as_ref().map(record_from_row).transpose()
    }

    async fn forget(&self, key: &StoreKey) -> Result<bool, StoreError> {
        let done = sqlx::query(self.sql.forget.clone())
            .bind(key.scope())
            .bind(key.key())
            .execute(&self.pool)
            .await
            .map_err(backend)?;
        Ok(done.rows_affected() > 0)
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let mut conn = self.connection().await?;
        let done = sqlx::query(self.sql.purge.clone())
            .bind(i64::from(batch))
            .execute(&mut *conn)
            .await
            .map_err(backend);
        let done = conn.check(done)?;
        Ok(done.rows_affected())
    }

    fn completions(&self) -> Option<Completions> {
        let channel = self.sql.channel.clone()?;
        let pool = self.pool.clone();
        Some(self.feed.subscribe(|sender| {
            keep_listening("postgres", sender, move |sender| {
                pg_notify::listen(pool.clone(), channel.clone(), sender)
            })
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_docs_show_the_default_schema() {
        // Users who run their own migrations copy the DDL from the docs: keep it in step.
        let source = include_str!("postgres.rs");
        for line in Statements::new(default_table(), true).schema.lines() {
            let documented = format!("/// {line}");
            assert!(
                source
                    .lines()
                    .any(|l| l.trim_end() == documented.trim_end()),
                "PostgresStore's docs lack the schema line {line:?}"
            );
        }
    }
}
