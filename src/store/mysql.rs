//! The MySQL / MariaDB store (feature `mysql`), on a sqlx [`MySqlPool`]. Tested against
//! MariaDB 10.11; needs InnoDB and MySQL 5.7+ or MariaDB 10.3+.
//!
//! The schema, the affected-rows handling and the clock are documented on [`MySqlStore`].

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use bytes::Bytes;
use sqlx::mysql::{MySqlConnection, MySqlDatabaseError, MySqlPool, MySqlQueryResult};
use sqlx::SqlStr;

use super::{sql_builder::sealed::Assemble, SqlStore, SqlStoreBuilder, Store, StoreError};
use crate::record::{ClaimOutcome, Fingerprint, Record, StoreKey, Token};
use crate::sql::{self, statement, TableName};

const BACKEND: &str = "mysql";
pub(crate) const NOW: &str = "UTC_TIMESTAMP(3)";

/// The width of the scope and key columns, in bytes.
pub(crate) const MAX_KEY_BYTES: usize = 1020;

/// How often a claim retries: after a deadlock (InnoDB rolls the victim's statement back, so
/// a retry is clean), or when the row it lost to vanished before it could be read.
const CLAIM_ATTEMPTS: usize = 8;

/// `DATETIME` ends in year 9999; an interval past it yields `NULL`. Refuse absurd durations
/// with a clear error instead of a server error about a NULL column.
const MAX_DURATION: Duration = Duration::from_secs(1000 * 366 * 24 * 3600);

/// InnoDB's "Deadlock found when trying to get lock".
const ER_LOCK_DEADLOCK: u16 = 1213;

/// InnoDB's "Lock wait timeout exceeded": with a zero wait, "another transaction holds it".
const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;

/// A [`Store`] in a MySQL or MariaDB table, on a sqlx [`MySqlPool`]. Clones share the pool.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_idempotency::store::MySqlStore;
///
/// let pool = sqlx::MySqlPool::connect("mysql://app@db.internal/app").await?;
/// let store = MySqlStore::new(pool);
/// store.migrate().await?;
/// # Ok(()) }
/// ```
///
/// # Schema
///
/// [`MySqlStore::migrate`] runs the following (shown for the default table; the exact text
/// for a store is [`MySqlStore::schema_sql`]). It is one idempotent statement, so you may also
/// copy it into your own migrations. The crate never touches sqlx's `_sqlx_migrations` table.
///
/// ```sql
/// CREATE TABLE IF NOT EXISTS tower_idempotency_records (
///     scope       VARBINARY(1020) NOT NULL,
///     `key`       VARBINARY(1020) NOT NULL,
///     fingerprint BINARY(32)      NOT NULL,
///     token       BINARY(16)      NULL,     -- NULL once completed
///     payload     LONGBLOB        NULL,     -- NULL while in progress
///     expires_at  DATETIME(3)     NOT NULL, -- UTC: lease end, then retention end
///     PRIMARY KEY (scope, `key`),
///     INDEX idx_expires_at (expires_at)
/// ) ENGINE = InnoDB ROW_FORMAT = DYNAMIC
/// ```
///
/// Scope and key are byte strings compared byte for byte: a `VARCHAR` with a `_bin`
/// collation would still ignore trailing spaces (PAD SPACE) on MariaDB and MySQL 5.7, making
/// `"k"` and `"k "` one record. 1020 bytes hold 255 characters of any UTF-8; the primary key
/// (2040 bytes) fits InnoDB's 3072-byte limit under the `DYNAMIC` row format. Longer scopes
/// or keys are refused before they reach the server, which outside strict mode would silently
/// truncate them into each other. Payloads are limited by the server's `max_allowed_packet`
/// (16 MiB by default on MariaDB, 64 MiB on MySQL 8).
///
/// # Clock
///
/// Times are the server's `UTC_TIMESTAMP(3)`, which is fixed for the duration of a statement
/// and, unlike `NOW()`, independent of the session time zone (two application instances with
/// different `time_zone` settings agree, and DST changes cannot move the clock back).
#[derive(Clone)]
pub struct MySqlStore {
    pool: MySqlPool,
    sql: Arc<Statements>,
}

/// Builds a [`MySqlStore`] on an existing pool, with a table name of your choice.
pub type MySqlStoreBuilder = SqlStoreBuilder<MySqlStore>;

/// Every statement, rendered once for the store's table.
#[derive(Debug)]
struct Statements {
    table: TableName,
    schema: String,
    claim: SqlStr,
    claim_nowait: SqlStr,
    read: SqlStr,
    probe: SqlStr,
    held: SqlStr,
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
        // Table-local index name: a name derived from a 63-character table name would pass
        // MySQL's 64-character identifier limit.
        let schema = format!(
            "CREATE TABLE IF NOT EXISTS {t} (\n    \
             scope       VARBINARY({MAX_KEY_BYTES}) NOT NULL,\n    \
             `key`       VARBINARY({MAX_KEY_BYTES}) NOT NULL,\n    \
             fingerprint BINARY(32)      NOT NULL,\n    \
             token       BINARY(16)      NULL,\n    \
             payload     LONGBLOB        NULL,\n    \
             expires_at  DATETIME(3)     NOT NULL,\n    \
             PRIMARY KEY (scope, `key`),\n    \
             INDEX idx_expires_at (expires_at)\n\
             ) ENGINE = InnoDB ROW_FORMAT = DYNAMIC"
        );
        let expired = format!("expires_at <= {NOW}");
        let fence = format!("scope = ? AND `key` = ? AND token = ? AND expires_at > {NOW}");
        // On a duplicate, every column keeps its value unless the existing record has
        // expired. MySQL evaluates the assignments left to right and a later IF() sees the
        // columns already assigned, so expires_at, which the test reads, is assigned
        // last: every IF() sees the original expiry. VALUES() rather than the 8.0.19 row
        // alias, which MariaDB does not parse.
        let claim = format!(
            "INSERT INTO {t} (scope, `key`, fingerprint, token, payload, expires_at) \
             VALUES (?, ?, ?, ?, NULL, {NOW} + INTERVAL ? MICROSECOND) \
             ON DUPLICATE KEY UPDATE \
             fingerprint = IF({expired}, VALUES(fingerprint), fingerprint), \
             token = IF({expired}, VALUES(token), token), \
             payload = IF({expired}, NULL, payload), \
             expires_at = IF({expired}, VALUES(expires_at), expires_at)"
        );
        Self {
            schema,
            // MariaDB's per-statement setting (10.3+): with a zero lock wait, an uncommitted
            // claim of another transaction makes the insert fail at once (1205) instead of
            // holding this connection until that transaction ends.
            claim_nowait: statement(format!(
                "SET STATEMENT innodb_lock_wait_timeout = 0 FOR {claim}"
            )),
            claim: statement(claim),
            read: statement(format!(
                "SELECT fingerprint, token, payload FROM {t} \
                 WHERE scope = ? AND `key` = ? AND expires_at > {NOW}"
            )),
            // A locking read that refuses to wait: it fails (1205) exactly when another
            // transaction holds the row, e.g. a transactional owner's uncommitted claim. In
            // autocommit the shared lock ends with the statement. MariaDB syntax (10.3+).
            probe: statement(format!(
                "SELECT fingerprint, payload FROM {t} \
                 WHERE scope = ? AND `key` = ? AND expires_at > {NOW} LOCK IN SHARE MODE NOWAIT"
            )),
            held: statement(format!("SELECT 1 FROM {t} WHERE {fence}")),
            renew: statement(format!(
                "UPDATE {t} SET expires_at = {NOW} + INTERVAL ? MICROSECOND WHERE {fence}"
            )),
            // Always a real change (token goes from a value to NULL), so rows-changed and
            // rows-matched agree and CLIENT_FOUND_ROWS cannot matter.
            complete: statement(format!(
                "UPDATE {t} SET token = NULL, payload = ?, \
                 expires_at = {NOW} + INTERVAL ? MICROSECOND WHERE {fence}"
            )),
            complete_held: statement(format!(
                "UPDATE {t} SET token = NULL, payload = ?, \
                 expires_at = {NOW} + INTERVAL ? MICROSECOND \
                 WHERE scope = ? AND `key` = ? AND token = ?"
            )),
            release: statement(format!("DELETE FROM {t} WHERE {fence}")),
            forget: statement(format!("DELETE FROM {t} WHERE scope = ? AND `key` = ?")),
            // ORDER BY the full index order (InnoDB appends the primary key to secondary
            // indexes) makes the batch deterministic, so statement-based replication deletes
            // the same rows on replicas, and walks the expiry index from its oldest end.
            purge: statement(format!(
                "DELETE FROM {t} WHERE {expired} ORDER BY expires_at, scope, `key` LIMIT ?"
            )),
            table,
        }
    }
}

impl SqlStore for MySqlStore {}

impl Assemble for MySqlStore {
    type Pool = MySqlPool;
    type Options = ();
    const DEFAULT_TABLE: &'static str = Self::DEFAULT_TABLE;

    fn assemble(pool: MySqlPool, table: TableName, (): ()) -> Self {
        Self {
            pool,
            sql: Arc::new(Statements::new(table)),
        }
    }
}

impl MySqlStore {
    /// The table used unless [`SqlStoreBuilder::table`] says otherwise.
    ///
    /// ```
    /// # use tower_idempotency::store::MySqlStore;
    /// assert_eq!(MySqlStore::DEFAULT_TABLE, "tower_idempotency_records");
    /// ```
    pub const DEFAULT_TABLE: &'static str = "tower_idempotency_records";

    /// A store on `pool` using the default table, [`DEFAULT_TABLE`](Self::DEFAULT_TABLE).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::store::MySqlStore;
    ///
    /// let store = MySqlStore::new(sqlx::MySqlPool::connect("mysql://app@db.internal/app").await?);
    /// # Ok(()) }
    /// ```
    pub fn new(pool: MySqlPool) -> Self {
        Self::assemble(
            pool,
            TableName::new(Self::DEFAULT_TABLE).expect("the default table name is valid"),
            (),
        )
    }

    /// A builder on `pool`, to choose the table name.
    ///
    /// ```
    /// use tower_idempotency::store::MySqlStore;
    ///
    /// # let runtime = tokio::runtime::Runtime::new().unwrap();
    /// # let _inside = runtime.enter();
    /// // A lazy pool never connects until used, so this runs without a server.
    /// let pool = sqlx::MySqlPool::connect_lazy("mysql://app@db.internal/app").unwrap();
    /// assert!(MySqlStore::builder(pool).table("records; DROP TABLE users").build().is_err());
    /// ```
    pub fn builder(pool: MySqlPool) -> MySqlStoreBuilder {
        SqlStoreBuilder::new(pool)
    }

    /// Creates the table (with its expiry index) if it does not exist. Idempotent, and safe
    /// to run from several tasks or processes at once: `CREATE TABLE IF NOT EXISTS` takes an
    /// exclusive metadata lock on the name, so concurrent runs queue up and all but the first
    /// find the table there.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::store::MySqlStore;
    ///
    /// let store = MySqlStore::new(sqlx::MySqlPool::connect("mysql://app@db.internal/app").await?);
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub async fn migrate(&self) -> Result<(), StoreError> {
        sqlx::raw_sql(sqlx::AssertSqlSafe(self.sql.schema.as_str()))
            .execute(&self.pool)
            .await
            .map_err(|err| sql::backend(BACKEND, err))?;
        Ok(())
    }

    /// The DDL [`migrate`](Self::migrate) runs, for this store's table.
    ///
    /// ```
    /// use tower_idempotency::store::MySqlStore;
    ///
    /// # let runtime = tokio::runtime::Runtime::new().unwrap();
    /// # let _inside = runtime.enter();
    /// let pool = sqlx::MySqlPool::connect_lazy("mysql://app@db.internal/app").unwrap();
    /// let store = MySqlStore::new(pool);
    /// assert!(store.schema_sql().starts_with("CREATE TABLE IF NOT EXISTS tower_idempotency_records"));
    /// ```
    pub fn schema_sql(&self) -> &str {
        &self.sql.schema
    }

    /// The table the records live in.
    ///
    /// ```
    /// use tower_idempotency::store::MySqlStore;
    ///
    /// # let runtime = tokio::runtime::Runtime::new().unwrap();
    /// # let _inside = runtime.enter();
    /// let pool = sqlx::MySqlPool::connect_lazy("mysql://app@db.internal/app").unwrap();
    /// assert_eq!(MySqlStore::new(pool).table().as_str(), "tower_idempotency_records");
    /// ```
    pub fn table(&self) -> &TableName {
        &self.sql.table
    }

    /// The underlying pool.
    ///
    /// ```
    /// use tower_idempotency::store::MySqlStore;
    ///
    /// # let runtime = tokio::runtime::Runtime::new().unwrap();
    /// # let _inside = runtime.enter();
    /// let pool = sqlx::MySqlPool::connect_lazy("mysql://app@db.internal/app").unwrap();
    /// assert_eq!(MySqlStore::new(pool).pool().size(), 0);
    /// ```
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// A connection for one operation, closed rather than reused if the operation finds its
    /// server read-only (a demoted primary) or, on Galera, cut from its cluster.
    async fn connection(&self) -> Result<sql::Checked<sqlx::MySql>, StoreError> {
        sql::Checked::acquire(&self.pool, BACKEND).await
    }

    /// Whether `token` holds a live claim on `key` right now.
    async fn holds(&self, key: &StoreKey, token: Token) -> Result<bool, StoreError> {
        let row = sqlx::query(self.sql.held.clone())
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(&token.to_bytes()[..])
            .fetch_optional(&self.pool)
            .await
            .map_err(|err| sql::backend(BACKEND, err))?;
        Ok(row.is_some())
    }

    /// The live row under `key`: fingerprint, token (NULL once completed), payload.
    async fn read<'e>(
        &self,
        executor: impl sqlx::Executor<'e, Database = sqlx::MySql>,
        key: &StoreKey,
    ) -> Result<Option<LiveRow>, StoreError> {
        sqlx::query_as(self.sql.read.clone())
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .fetch_optional(executor)
            .await
            .map_err(|err| sql::backend(BACKEND, err))
    }

    /// The claim on one connection, in autocommit (separate mode) or inside the caller's
    /// transaction (transactional mode, with [`Wait::Never`]: `Ok(None)` then means another
    /// transaction holds the key's row lock right now).
    ///
    /// Who won is decided by the one `INSERT .. ON DUPLICATE KEY UPDATE`; telling the caller
    /// needs care, because its affected-rows count depends on CLIENT_FOUND_ROWS:
    ///
    /// | row was             | without the flag | with it (sqlx always sets it) |
    /// |---------------------|------------------|-------------------------------|
    /// | absent: inserted    | 1                | 1                             |
    /// | expired: taken over | 2                | 2                             |
    /// | live: left alone    | 0                | 1                             |
    ///
    /// 2 means a takeover in both modes: done in one round trip. Anything else is settled by
    /// reading the live row and comparing its token with ours. The statement writes our fresh
    /// random token exactly when we win and nobody else can ever write it, so "the stored
    /// token is ours" proves we won; the read cannot turn a loss into a win. The one thing
    /// that can happen between the two statements is that the winner's record moves on
    /// (completed, released, or, with a lease shorter than a round trip, taken over): then we
    /// report what is there now, or claim again if nothing is, as any later claim would.
    /// This costs a fresh key a second (primary-key) read, but needs neither a transaction
    /// holding a row lock across round trips nor tricks with LAST_INSERT_ID() whose effect on
    /// the OK packet differs between server versions.
    pub(crate) async fn claim_on(
        &self,
        conn: &mut MySqlConnection,
        wait: Wait,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        check_width(key)?;
        let lease = micros(lease)?;
        let statement = match wait {
            Wait::Queue => &self.sql.claim,
            Wait::Never => &self.sql.claim_nowait,
        };
        for _ in 0..CLAIM_ATTEMPTS {
            let token = Token::random();
            let result = sqlx::query(statement.clone())
                .bind(key.scope().as_bytes())
                .bind(key.key().as_bytes())
                .bind(&fingerprint.as_bytes()[..])
                .bind(&token.to_bytes()[..])
                .bind(lease)
                .execute(&mut *conn)
                .await;
            let rows = match result {
                Ok(done) => done.rows_affected(),
                Err(err) if is_lock_conflict(&err, ER_LOCK_WAIT_TIMEOUT) => return Ok(None),
                // A deadlock victim's transaction is rolled back whole: inside a caller's
                // transaction there is nothing to retry on, so it counts as busy.
                Err(err) if is_lock_conflict(&err, ER_LOCK_DEADLOCK) => match wait {
                    Wait::Queue => continue,
                    Wait::Never => return Ok(None),
                },
                Err(err) => return Err(backend(err)),
            };
            if rows == 2 {
                return Ok(Some(ClaimOutcome::Claimed(token)));
            }
            let Some((fingerprint, stored, payload)) = self.read(&mut *conn, key).await? else {
                continue;
            };
            if let Some(stored) = stored {
                if sql::decode_token(BACKEND, &stored)? == token {
                    return Ok(Some(ClaimOutcome::Claimed(token)));
                }
            }
            return sql::decode_record(BACKEND, &fingerprint, payload)
                .map(|record| Some(ClaimOutcome::Existing(record)));
        }
        Err(StoreError::backend(
            BACKEND,
            "a claim kept deadlocking or losing to records that vanished before they could be read",
        ))
    }

    /// Completes, inside the owner's transaction `conn`, the claim that transaction made with
    /// `token` (the transactional mode: the lease does not matter while the transaction
    /// holds the row).
    pub(crate) async fn complete_held(
        &self,
        conn: &mut MySqlConnection,
        key: &StoreKey,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let statement = self.sql.complete_held.clone();
        self.complete_with(statement, conn, key, token, payload, retention)
            .await
    }

    /// Runs a complete `statement` for the claim held by `token` on `conn`.
    async fn complete_with(
        &self,
        statement: SqlStr,
        conn: &mut MySqlConnection,
        key: &StoreKey,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let result = sqlx::query(statement)
            .bind(payload.as_ref())
            .bind(micros(retention)?)
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(&token.to_bytes()[..])
            .execute(conn)
            .await
            .map_err(backend)?;
        sql::fenced(result.rows_affected())
    }

    /// The committed live record under `key`, or `None` when there is none or another
    /// transaction holds the key right now (`busy`), without waiting for that transaction.
    pub(crate) async fn probe(
        &self,
        key: &StoreKey,
    ) -> Result<Result<Option<Record>, Busy>, StoreError> {
        let row: Result<Option<RecordRow>, _> = sqlx::query_as(self.sql.probe.clone())
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .fetch_optional(&self.pool)
            .await;
        match row {
            Ok(row) => row
                .map(|(fingerprint, payload)| sql::decode_record(BACKEND, &fingerprint, payload))
                .transpose()
                .map(Ok),
            Err(err) if is_lock_conflict(&err, ER_LOCK_WAIT_TIMEOUT) => Ok(Err(Busy)),
            Err(err) => Err(backend(err)),
        }
    }
}

type LiveRow = (Vec<u8>, Option<Vec<u8>>, Option<Vec<u8>>);

/// A live record's fingerprint and payload (NULL while in progress).
type RecordRow = (Vec<u8>, Option<Vec<u8>>);

/// Whether a claim may queue behind another transaction's lock on the key's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Autocommit claims hold a row lock for one statement: queueing is brief.
    Queue,
    /// Inside a transaction the lock lasts as long as its owner runs: fail at once instead.
    Never,
}

/// Another transaction holds the key right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Busy;

impl std::fmt::Debug for MySqlStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlStore")
            .field("table", &self.sql.table)
            .field("connections", &self.pool.size())
            .finish()
    }
}

/// Refuses scopes and keys wider than their columns, which a server outside strict mode
/// would truncate on insert, merging distinct keys. Only the claim needs it: elsewhere an
/// overlong value is only compared, and simply matches nothing.
fn check_width(key: &StoreKey) -> Result<(), StoreError> {
    for (what, value) in [("scope", key.scope()), ("key", key.key())] {
        if value.len() > MAX_KEY_BYTES {
            return Err(StoreError::Config(format!(
                "an idempotency {what} of {} bytes exceeds the mysql store's {MAX_KEY_BYTES}",
                value.len()
            )));
        }
    }
    Ok(())
}

/// A duration as microseconds for `INTERVAL .. MICROSECOND` (DATETIME(3) keeps whole
/// milliseconds, so the duration is cut to those first, through the shared helper).
fn micros(duration: Duration) -> Result<i64, StoreError> {
    if duration > MAX_DURATION {
        return Err(StoreError::Config(format!(
            "duration {duration:?} is too long for the mysql store (at most 1000 years)"
        )));
    }
    Ok(sql::millis(duration)? * 1000)
}

/// Whether a statement of a transaction, or its commit, failed with InnoDB's deadlock error
/// (1213), which Galera also gives a transaction that lost a certification conflict: the
/// server rolled the whole transaction back.
pub(crate) fn lost_at_commit(error: &StoreError) -> bool {
    let StoreError::Backend { source, .. } = error else {
        return false;
    };
    source
        .downcast_ref::<sqlx::Error>()
        .is_some_and(|error| is_lock_conflict(error, ER_LOCK_DEADLOCK))
}

fn is_lock_conflict(error: &sqlx::Error, number: u16) -> bool {
    error
        .as_database_error()
        .and_then(|db| db.try_downcast_ref::<MySqlDatabaseError>())
        .is_some_and(|db| db.number() == number)
}

fn backend(error: sqlx::Error) -> StoreError {
    sql::backend(BACKEND, error)
}

#[async_trait]
impl Store for MySqlStore {
    /// Who won is decided by the one `INSERT .. ON DUPLICATE KEY UPDATE`; telling the caller
    /// needs care, because its affected-rows count depends on CLIENT_FOUND_ROWS:
    ///
    /// | row was             | without the flag | with it (sqlx always sets it) |
    /// |---------------------|------------------|-------------------------------|
    /// | absent: inserted    | 1                | 1                             |
    /// | expired: taken over | 2                | 2                             |
    /// | live: left alone    | 0                | 1                             |
    ///
    /// 2 means a takeover in both modes: done in one round trip. Anything else is settled by
    /// reading the live row and comparing its token with ours. The statement writes our fresh
    /// random token exactly when we win and nobody else can ever write it, so "the stored
    /// token is ours" proves we won; the read cannot turn a loss into a win. The one thing
    /// that can happen between the two statements is that the winner's record moves on
    /// (completed, released, or, with a lease shorter than a round trip, taken over): then we
    /// report what is there now, or claim again if nothing is, as any later claim would.
    /// This costs a fresh key a second (primary-key) read, but needs neither a transaction
    /// holding a row lock across round trips nor tricks with LAST_INSERT_ID() whose effect on
    /// the OK packet differs between server versions.
    async fn claim(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        // Both statements on one connection: one pool checkout per claim.
        let mut conn = self.connection().await?;
        let claimed = self
            .claim_on(&mut conn, Wait::Queue, key, fingerprint, lease)
            .await;
        let claimed = conn.check(claimed)?;
        claimed.ok_or_else(|| {
            StoreError::backend(BACKEND, "a claim that may wait reported a busy lock")
        })
    }

    async fn renew(&self, key: &StoreKey, token: Token, lease: Duration) -> Result<(), StoreError> {
        let lease = micros(lease)?;
        let mut conn = self.connection().await?;
        let result = sqlx::query(self.sql.renew.clone())
            .bind(lease)
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(&token.to_bytes()[..])
            .execute(&mut *conn)
            .await
            .map_err(backend);
        let result: MySqlQueryResult = conn.check(result)?;
        drop(conn);
        if result.rows_affected() > 0 {
            return Ok(());
        }
        // Without CLIENT_FOUND_ROWS a renew that lands in the same millisecond as the last one
        // writes an identical expiry and reports 0 rows changed although it matched. A token
        // that lost its claim never holds one again, so if it holds one now the renew matched.
        if self.holds(key, token).await? {
            Ok(())
        } else {
            Err(StoreError::StaleToken)
        }
    }

    async fn complete(
        &self,
        key: &StoreKey,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let mut conn = self.connection().await?;
        let statement = self.sql.complete.clone();
        let done = self
            .complete_with(statement, &mut conn, key, token, payload, retention)
            .await;
        conn.check(done)
    }

    async fn release(&self, key: &StoreKey, token: Token) -> Result<(), StoreError> {
        let mut conn = self.connection().await?;
        let result = sqlx::query(self.sql.release.clone())
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(&token.to_bytes()[..])
            .execute(&mut *conn)
            .await
            .map_err(backend);
        let result = conn.check(result)?;
        sql::fenced(result.rows_affected())
    }

    async fn lookup(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        self.read(&self.pool, key)
            .await?
            .map(|(fingerprint, _, payload)| sql::decode_record(BACKEND, &fingerprint, payload))
            .transpose()
    }

    async fn forget(&self, key: &StoreKey) -> Result<bool, StoreError> {
        let result = sqlx::query(self.sql.forget.clone())
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .execute(&self.pool)
            .await
            .map_err(backend)?;
        Ok(result.rows_affected() > 0)
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let result = sqlx::query(self.sql.purge.clone())
            .bind(batch)
            .execute(&self.pool)
            .await
            .map_err(backend)?;
        Ok(result.rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The renew fallback only runs on connections without CLIENT_FOUND_ROWS, which sqlx
    /// cannot open, so the read it relies on is exercised here directly.
    #[tokio::test]
    async fn holds_tells_a_live_claim_from_a_stale_token() {
        let Ok(url) = std::env::var("TEST_MYSQL_URL") else {
            eprintln!("skipped: TEST_MYSQL_URL is not set");
            return;
        };
        let store = MySqlStore::new(MySqlPool::connect(&url).await.unwrap());
        store.migrate().await.unwrap();
        let key = StoreKey::new(Token::random().to_hex(), "k");
        let fingerprint = Fingerprint::of([b"a".as_slice()]);
        let ClaimOutcome::Claimed(token) = store
            .claim(&key, &fingerprint, Duration::from_secs(30))
            .await
            .unwrap()
        else {
            panic!("a fresh key must be claimable");
        };
        assert!(store.holds(&key, token).await.unwrap());
        assert!(!store.holds(&key, Token::random()).await.unwrap());
        store.release(&key, token).await.unwrap();
        assert!(!store.holds(&key, token).await.unwrap());
    }

    #[test]
    fn durations_and_widths_are_checked_before_reaching_the_server() {
        assert_eq!(micros(Duration::from_millis(1500)).unwrap(), 1_500_000);
        assert!(matches!(
            micros(Duration::from_secs(u64::MAX)),
            Err(StoreError::Config(_))
        ));
        assert!(check_width(&StoreKey::new("s", "k".repeat(MAX_KEY_BYTES))).is_ok());
        assert!(check_width(&StoreKey::new("s".repeat(MAX_KEY_BYTES + 1), "k")).is_err());
    }
}
