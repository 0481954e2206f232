//! The SQLite store (feature `sqlite`): durable records in one database file, for a single
//! host (one process or several sharing the file). Several hosts need a server database.
//!
//! The schema, the connection settings and the clock are documented on [`SqliteStore`].

use std::{path::Path, str::FromStr, sync::Arc, time::Duration};

use async_trait::async_trait;
use bytes::Bytes;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
};
use sqlx::SqlStr;

use super::{sql_builder::sealed::Assemble, SqlStore, SqlStoreBuilder, Store, StoreError};
use crate::record::{ClaimOutcome, Fingerprint, Record, StoreKey, Token};
use crate::sql::{self, statement, TableName};

const BACKEND: &str = "sqlite";

/// SQLite's clock in whole Unix milliseconds. `'now'` is fixed for one statement, so every
/// use within a statement agrees. `unixepoch('subsec')` is exact to the millisecond, but as a
/// float: round before the cast so 0.999.. never truncates a millisecond away.
pub(crate) const NOW_MS: &str = "CAST(round(unixepoch('subsec') * 1000) AS INTEGER)";

/// How often a claim retries when the row it lost to vanished before it could be read
/// (released or purged in between). Each retry means another claim made progress, so
/// running out takes a pathological storm of claims and releases on one key.
const CLAIM_ATTEMPTS: usize = 8;

/// A [`Store`] in a SQLite database, on a sqlx [`SqlitePool`]. Clones share the pool.
///
/// ```
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_idempotency::store::SqliteStore;
///
/// let path = std::env::temp_dir().join("tower-idempotency-doc-sqlite.db");
/// let store = SqliteStore::open(&path).await?;
/// store.migrate().await?;
/// # Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
/// ```
///
/// # Schema
///
/// [`SqliteStore::migrate`] runs the following (shown for the default table; the exact text
/// for a store is [`SqliteStore::schema_sql`]). Both statements are idempotent, so you may
/// also copy them into your own migrations instead. The crate never touches sqlx's
/// `_sqlx_migrations` table, so it cannot collide with your migrations.
///
/// ```sql
/// CREATE TABLE IF NOT EXISTS tower_idempotency_records (
///     scope       TEXT    NOT NULL,
///     "key"       TEXT    NOT NULL,
///     fingerprint BLOB    NOT NULL, -- 32 bytes
///     token       BLOB,             -- 16 bytes while in progress, NULL once completed
///     payload     BLOB,             -- NULL while in progress
///     expires_at  INTEGER NOT NULL, -- Unix ms: lease end, then retention end
///     PRIMARY KEY (scope, "key")
/// );
/// CREATE INDEX IF NOT EXISTS tower_idempotency_records_expires_at_idx
///     ON tower_idempotency_records (expires_at);
/// ```
///
/// # Connection settings
///
/// [`SqliteStore::open`] and [`SqliteStore::connect`] set what concurrent claims need:
/// WAL journal mode (readers never block the writer), a 5 s busy timeout (a writer waits for
/// the lock instead of failing with "database is locked") and `create_if_missing`. If you
/// build the pool yourself, pass your options through [`SqliteStore::durable_options`].
///
/// # Clock and atomicity
///
/// Times are milliseconds of SQLite's own clock (`unixepoch('subsec')`, SQLite 3.42+; the
/// `sqlite` feature bundles 3.46), which is fixed for the duration of one statement. A claim
/// is one `INSERT .. ON CONFLICT DO UPDATE .. WHERE <expired> RETURNING` statement, executed
/// under SQLite's single write lock: the first writer decides, every other claim waits for the
/// lock and then sees its row.
#[derive(Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    sql: Arc<Statements>,
    /// The transactional mode's owners of this process take turns here (SQLite has one
    /// writer): shared by the store's clones, as the pool is.
    writers: crate::transactional::WriterQueue,
}

/// Builds a [`SqliteStore`] on an existing pool, with a table name of your choice.
pub type SqliteStoreBuilder = SqlStoreBuilder<SqliteStore>;

/// Every statement, rendered once for the store's table.
#[derive(Debug)]
struct Statements {
    table: TableName,
    schema: [String; 2],
    /// `schema` as one `;`-separated script, for [`SqliteStore::schema_sql`].
    script: String,
    claim: SqlStr,
    lookup: SqlStr,
    renew: SqlStr,
    complete: SqlStr,
    /// `complete` for the transactional mode, fenced by the token alone: the row is the
    /// owner's own claim, locked by its open transaction, so nobody can have taken it over,
    /// however long the operation ran past the lease.
    complete_held: SqlStr,
    release: SqlStr,
    forget: SqlStr,
    purge: SqlStr,
}

impl Statements {
    fn new(table: TableName) -> Self {
        let t = table.as_str();
        // SQLite qualifies the index name, not the table, with the schema, and index names
        // share one namespace per schema: derive one from the table name.
        let index = match t.split_once('.') {
            Some((schema, _)) => format!("{schema}.{}", table.derived("expires_at_idx")),
            None => table.derived("expires_at_idx"),
        };
        let bare = t.rsplit('.').next().unwrap_or(t);
        let schema = [
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (\n    \
                     scope       TEXT    NOT NULL,\n    \
                     \"key\"       TEXT    NOT NULL,\n    \
                     fingerprint BLOB    NOT NULL,\n    \
                     token       BLOB,\n    \
                     payload     BLOB,\n    \
                     expires_at  INTEGER NOT NULL,\n    \
                     PRIMARY KEY (scope, \"key\")\n)"
            ),
            format!("CREATE INDEX IF NOT EXISTS {index}\n    ON {bare} (expires_at)"),
        ];
        Self {
            script: schema.join(";\n") + ";\n",
            schema,
            // A returned row means this statement wrote our token: either the key was new, or
            // the DO UPDATE's WHERE found the existing record expired. The bare `expires_at`
            // in that WHERE is the existing row's; `excluded` is the row we tried to insert.
            claim: statement(format!(
                "INSERT INTO {t} (scope, \"key\", fingerprint, token, payload, expires_at) \
                 VALUES (?1, ?2, ?3, ?4, NULL, {NOW_MS} + ?5) \
                 ON CONFLICT (scope, \"key\") DO UPDATE SET \
                 fingerprint = excluded.fingerprint, token = excluded.token, payload = NULL, \
                 expires_at = excluded.expires_at \
                 WHERE expires_at <= {NOW_MS} \
                 RETURNING 1"
            )),
            lookup: statement(format!(
                "SELECT fingerprint, payload FROM {t} \
                 WHERE scope = ?1 AND \"key\" = ?2 AND expires_at > {NOW_MS}"
            )),
            renew: statement(format!(
                "UPDATE {t} SET expires_at = {NOW_MS} + ?4 \
                 WHERE scope = ?1 AND \"key\" = ?2 AND token = ?3 AND expires_at > {NOW_MS}"
            )),
            complete: statement(format!(
                "UPDATE {t} SET token = NULL, payload = ?4, expires_at = {NOW_MS} + ?5 \
                 WHERE scope = ?1 AND \"key\" = ?2 AND token = ?3 AND expires_at > {NOW_MS}"
            )),
            complete_held: statement(format!(
                "UPDATE {t} SET token = NULL, payload = ?4, expires_at = {NOW_MS} + ?5 \
                 WHERE scope = ?1 AND \"key\" = ?2 AND token = ?3"
            )),
            release: statement(format!(
                "DELETE FROM {t} \
                 WHERE scope = ?1 AND \"key\" = ?2 AND token = ?3 AND expires_at > {NOW_MS}"
            )),
            forget: statement(format!("DELETE FROM {t} WHERE scope = ?1 AND \"key\" = ?2")),
            // Through rowid so the batch can be bounded (plain DELETE .. LIMIT needs a
            // compile-time option the bundled SQLite lacks).
            purge: statement(format!(
                "DELETE FROM {t} WHERE rowid IN \
                 (SELECT rowid FROM {t} WHERE expires_at <= {NOW_MS} LIMIT ?1)"
            )),
            table,
        }
    }
}

impl SqlStore for SqliteStore {}

impl Assemble for SqliteStore {
    type Pool = SqlitePool;
    type Options = ();
    const DEFAULT_TABLE: &'static str = Self::DEFAULT_TABLE;

    fn assemble(pool: SqlitePool, table: TableName, (): ()) -> Self {
        Self {
            pool,
            sql: Arc::new(Statements::new(table)),
            writers: Default::default(),
        }
    }
}

impl SqliteStore {
    /// The table used unless [`SqlStoreBuilder::table`] says otherwise.
    ///
    /// ```
    /// # use tower_idempotency::store::SqliteStore;
    /// assert_eq!(SqliteStore::DEFAULT_TABLE, "tower_idempotency_records");
    /// ```
    pub const DEFAULT_TABLE: &'static str = "tower_idempotency_records";

    /// A store on `pool` using the default table, [`DEFAULT_TABLE`](Self::DEFAULT_TABLE).
    ///
    /// Configure the pool's connections with [`durable_options`](Self::durable_options) (WAL,
    /// busy timeout): without a busy timeout, concurrent claims fail with "database is locked"
    /// instead of waiting their turn.
    ///
    /// ```
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::str::FromStr;
    /// use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    /// use tower_idempotency::store::SqliteStore;
    ///
    /// let path = std::env::temp_dir().join("tower-idempotency-doc-own-pool.db");
    /// let options = SqliteStore::durable_options(SqliteConnectOptions::new().filename(path));
    /// let pool = SqlitePoolOptions::new().max_connections(4).connect_with(options).await?;
    /// let store = SqliteStore::new(pool);
    /// store.migrate().await?;
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub fn new(pool: SqlitePool) -> Self {
        Self::assemble(
            pool,
            TableName::new(Self::DEFAULT_TABLE).expect("the default table name is valid"),
            (),
        )
    }

    /// A builder on `pool`, to choose the table name.
    ///
    /// ```
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::store::SqliteStore;
    ///
    /// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
    /// let refused = SqliteStore::builder(pool).table("records; DROP TABLE users").build();
    /// assert!(refused.is_err());
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub fn builder(pool: SqlitePool) -> SqliteStoreBuilder {
        SqlStoreBuilder::new(pool)
    }

    /// Opens (creating if missing) the database file at `path` with
    /// [`durable_options`](Self::durable_options), on a pool with sqlx's default size.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
    /// use tower_idempotency::store::SqliteStore;
    ///
    /// let store = SqliteStore::open("/var/lib/myapp/idempotency.db").await?;
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::connect_with(SqliteConnectOptions::new().filename(path)).await
    }

    /// Like [`open`](Self::open), from a sqlx URL such as `sqlite://data/idempotency.db`
    /// (sqlx's URL parameters apply; the durable settings are added on top).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
    /// use tower_idempotency::store::SqliteStore;
    ///
    /// let store = SqliteStore::connect("sqlite://data/idempotency.db").await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options =
            SqliteConnectOptions::from_str(url).map_err(|err| sql::backend(BACKEND, err))?;
        Self::connect_with(options).await
    }

    async fn connect_with(options: SqliteConnectOptions) -> Result<Self, StoreError> {
        let pool = SqlitePoolOptions::new()
            .connect_with(Self::durable_options(options))
            .await
            .map_err(|err| sql::backend(BACKEND, err))?;
        Ok(Self::new(pool))
    }

    /// `options` plus what this store needs under concurrency: WAL journal mode, a 5 s busy
    /// timeout and `create_if_missing`. Synchronous mode stays at SQLite's default `FULL`:
    /// a completed record lost in a power cut would let a retry run the operation again.
    ///
    /// Switching a database file to WAL takes an exclusive lock that cannot wait, so when many
    /// processes open a brand-new file at the same instant one of them may fail once with
    /// "database is locked"; once the file is in WAL mode (a persistent setting) it cannot.
    ///
    /// ```
    /// use sqlx::sqlite::SqliteConnectOptions;
    /// use tower_idempotency::store::SqliteStore;
    ///
    /// let options = SqliteStore::durable_options(SqliteConnectOptions::new().filename("app.db"));
    /// # let _ = options;
    /// ```
    pub fn durable_options(options: SqliteConnectOptions) -> SqliteConnectOptions {
        options
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(5))
            .create_if_missing(true)
    }

    /// Creates the table and its expiry index if they do not exist. Idempotent, and safe to
    /// run from several tasks or processes at once.
    ///
    /// ```
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::store::SqliteStore;
    ///
    /// let store = SqliteStore::new(sqlx::SqlitePool::connect("sqlite::memory:").await?);
    /// store.migrate().await?;
    /// store.migrate().await?; // a no-op the second time
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub async fn migrate(&self) -> Result<(), StoreError> {
        // Two autocommit statements, deliberately not one transaction: a deferred transaction
        // that read the schema and then must write fails at once (SQLITE_BUSY_SNAPSHOT, no
        // busy wait) if a concurrent migrate committed first. Alone, each statement waits for
        // the write lock and is re-prepared if the schema changed meanwhile, at which point
        // IF NOT EXISTS makes it a no-op.
        for statement in &self.sql.schema {
            sqlx::query(sqlx::AssertSqlSafe(statement.as_str()))
                .execute(&self.pool)
                .await
                .map_err(|err| sql::backend(BACKEND, err))?;
        }
        Ok(())
    }

    /// The DDL [`migrate`](Self::migrate) runs, for this store's table, as a `;`-separated
    /// script you can put in your own migrations.
    ///
    /// ```
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::store::SqliteStore;
    ///
    /// let store = SqliteStore::new(sqlx::SqlitePool::connect("sqlite::memory:").await?);
    /// assert!(store.schema_sql().starts_with("CREATE TABLE IF NOT EXISTS tower_idempotency_records"));
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub fn schema_sql(&self) -> &str {
        &self.sql.script
    }

    /// The table the records live in.
    ///
    /// ```
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::store::SqliteStore;
    ///
    /// let store = SqliteStore::new(sqlx::SqlitePool::connect("sqlite::memory:").await?);
    /// assert_eq!(store.table().as_str(), "tower_idempotency_records");
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub fn table(&self) -> &TableName {
        &self.sql.table
    }

    /// The underlying pool.
    ///
    /// ```
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::store::SqliteStore;
    ///
    /// let store = SqliteStore::new(sqlx::SqlitePool::connect("sqlite::memory:").await?);
    /// store.pool().close().await;
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The queue the transactional mode's owners of this process take turns in.
    pub(crate) fn writers(&self) -> &crate::transactional::WriterQueue {
        &self.writers
    }

    /// Runs a fenced statement (`renew`, `complete`, `release`): SQLite counts the rows it
    /// matched, so zero means the token does not hold a live claim.
    fn fenced(
        result: Result<sqlx::sqlite::SqliteQueryResult, sqlx::Error>,
    ) -> Result<(), StoreError> {
        sql::fenced(
            result
                .map_err(|err| sql::backend(BACKEND, err))?
                .rows_affected(),
        )
    }
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("table", &self.sql.table)
            .field("connections", &self.pool.size())
            .finish()
    }
}

impl SqliteStore {
    /// The claim on one connection: in autocommit (separate mode), or inside the caller's
    /// transaction (transactional mode), which then holds the database's write lock.
    pub(crate) async fn claim_on(
        &self,
        conn: &mut SqliteConnection,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        let lease = sql::millis(lease)?;
        for _ in 0..CLAIM_ATTEMPTS {
            let token = Token::random();
            // fetch_all steps the statement to completion, so its autocommit write (and the
            // database's single write lock) is finished before we act on the answer, whatever
            // the driver does with a statement that is read only halfway.
            let won = sqlx::query(self.sql.claim.clone())
                .bind(key.scope())
                .bind(key.key())
                .bind(&fingerprint.as_bytes()[..])
                .bind(&token.to_bytes()[..])
                .bind(lease)
                .fetch_all(&mut *conn)
                .await
                .map_err(backend)?;
            if !won.is_empty() {
                return Ok(ClaimOutcome::Claimed(token));
            }
            // The insert decided we lost; reading what won cannot change that. If it is gone
            // by now (released, or it expired and was purged), the key is free again: retry.
            if let Some(record) = self.lookup_on(&mut *conn, key).await? {
                return Ok(ClaimOutcome::Existing(record));
            }
        }
        Err(StoreError::backend(
            BACKEND,
            "a claim kept losing to records that vanished before they could be read",
        ))
    }

    /// Completes, inside the owner's transaction `conn`, the claim that transaction made with
    /// `token` (the transactional mode: the lease does not matter while the transaction
    /// holds the row).
    pub(crate) async fn complete_held(
        &self,
        conn: &mut sqlx::SqliteConnection,
        key: &StoreKey,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let statement = self.sql.complete_held.clone();
        self.complete_with(statement, conn, key, token, payload, retention)
            .await
    }

    /// Runs a complete `statement` for the claim held by `token` through `executor`.
    async fn complete_with<'e>(
        &self,
        statement: SqlStr,
        executor: impl sqlx::Executor<'e, Database = sqlx::Sqlite>,
        key: &StoreKey,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let result = sqlx::query(statement)
            .bind(key.scope())
            .bind(key.key())
            .bind(&token.to_bytes()[..])
            .bind(payload.as_ref())
            .bind(sql::millis(retention)?)
            .execute(executor)
            .await;
        Self::fenced(result)
    }

    /// The live record under `key`, read through `executor`.
    pub(crate) async fn lookup_on<'e>(
        &self,
        executor: impl sqlx::Executor<'e, Database = sqlx::Sqlite>,
        key: &StoreKey,
    ) -> Result<Option<Record>, StoreError> {
        let row: Option<(Vec<u8>, Option<Vec<u8>>)> = sqlx::query_as(self.sql.lookup.clone())
            .bind(key.scope())
            .bind(key.key())
            .fetch_optional(executor)
            .await
            .map_err(backend)?;
        row.map(|(fingerprint, payload)| sql::decode_record(BACKEND, &fingerprint, payload))
            .transpose()
    }
}

fn backend(error: sqlx::Error) -> StoreError {
    sql::backend(BACKEND, error)
}

#[async_trait]
impl Store for SqliteStore {
    async fn claim(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(backend)?;
        self.claim_on(&mut conn, key, fingerprint, lease).await
    }

    async fn renew(&self, key: &StoreKey, token: Token, lease: Duration) -> Result<(), StoreError> {
        let result = sqlx::query(self.sql.renew.clone())
            .bind(key.scope())
            .bind(key.key())
            .bind(&token.to_bytes()[..])
            .bind(sql::millis(lease)?)
            .execute(&self.pool)
            .await;
        Self::fenced(result)
    }

    async fn complete(
        &self,
        key: &StoreKey,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let statement = self.sql.complete.clone();
        self.complete_with(statement, &self.pool, key, token, payload, retention)
            .await
    }

    async fn release(&self, key: &StoreKey, token: Token) -> Result<(), StoreError> {
        let result = sqlx::query(self.sql.release.clone())
            .bind(key.scope())
            .bind(key.key())
            .bind(&token.to_bytes()[..])
            .execute(&self.pool)
            .await;
        Self::fenced(result)
    }

    async fn lookup(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        self.lookup_on(&self.pool, key).await
    }

    async fn forget(&self, key: &StoreKey) -> Result<bool, StoreError> {
        let result = sqlx::query(self.sql.forget.clone())
            .bind(key.scope())
            .bind(key.key())
            .execute(&self.pool)
            .await
            .map_err(|err| sql::backend(BACKEND, err))?;
        Ok(result.rows_affected() > 0)
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let result = sqlx::query(self.sql.purge.clone())
            .bind(batch)
            .execute(&self.pool)
            .await
            .map_err(|err| sql::backend(BACKEND, err))?;
        Ok(result.rows_affected())
    }
}
