//! The one outbox code path: [`SqlOutbox`] runs a table of statements each database renders
//! once (its own file: `postgres.rs`, `mysql.rs`, `sqlite.rs`), the way
//! [`SqlStoreBuilder`](crate::store::SqlStoreBuilder) assembles the SQL stores.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use sqlx::{Database, Executor, IntoArguments, Pool, SqlStr};

use super::refusals::{error_text, ParkedRow, RefusalPolicy};
use super::{count, decode_batch, Batch, NewEvent, OutboxError, OutboxSource, DEFAULT_TABLE};
use crate::broker::{deadline, error_chain, Publisher, Verdict};
use crate::sql::{statement, AddedColumn, Query, TableName};

/// How long one batch's publish may take when the outbox is not told otherwise
/// ([`SqlOutbox::publish_timeout`]): three times a broker call's own limit.
pub const DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(30);

/// The outbox table on one database; use it by its names [`PgOutbox`](super::PgOutbox),
/// [`MySqlOutbox`](super::MySqlOutbox) and [`SqliteOutbox`](super::SqliteOutbox). Clones
/// share the pool.
pub struct SqlOutbox<DB: OutboxDatabase> {
    pub(super) pool: Pool<DB>,
    pub(super) sql: Arc<Statements>,
    refusals: RefusalPolicy,
    publish_timeout: Duration,
}

/// A database [`SqlOutbox`] runs on: PostgreSQL, MySQL / MariaDB, SQLite. Implemented by this
/// crate only.
pub trait OutboxDatabase: sealed::Dialect {}

impl<DB: sealed::Dialect> OutboxDatabase for DB {}

pub(crate) mod sealed {
    use std::{sync::Arc, time::Duration};

    use tokio::sync::Notify;

    use super::{with_each_seq, Statements};
    use crate::sql::{OwnTable, Query, TableName};

    /// What differs between databases: the SQL text, how parameters are bound, how a relay's
    /// transaction starts, and the wake-up. The defaults are MySQL's and SQLite's.
    pub trait Dialect: OwnTable {
        /// Sent on the relay's connection before its transaction begins.
        const RELAY_SETUP: Option<&'static str> = None;
        /// The statement that begins the relay's transactions; `None`: sqlx's `BEGIN`.
        const RELAY_BEGIN: Option<&'static str> = None;
        /// Whether `take` leases the rows (one short transaction, then the publish outside
        /// any transaction) rather than locking them until the batch commits.
        const LEASES: bool = false;

        /// The statements for `table`, rendered once.
        fn statements(table: TableName) -> Statements;

        /// Binds the batch size and the lease to the `take` statement (by default the batch
        /// size only: rows locked need no lease).
        fn bind_take(query: Query<Self>, limit: u32, lease: Duration) -> Query<Self>
        where
            i64: sqlx::Encode<'static, Self> + sqlx::Type<Self>,
        {
            let _ = lease;
            query.bind(i64::from(limit))
        }

        /// `statement` (`mark` or `release`) with `seqs` bound: by default
        /// `<statement>(?, ?, ...)`, one placeholder per row (no arrays).
        fn with_seqs(statement: &sqlx::SqlStr, seqs: Vec<i64>) -> Query<Self>
        where
            i64: sqlx::Encode<'static, Self> + sqlx::Type<Self>,
        {
            with_each_seq(statement, seqs)
        }

        /// Wakes `wake` on every commit that enqueued events, where the database can tell.
        fn listen(
            pool: &sqlx::Pool<Self>,
            sql: &Statements,
            wake: Arc<Notify>,
        ) -> Option<tokio::task::JoinHandle<()>> {
            let _ = (pool, sql, wake);
            None
        }
    }
}

/// The statements of one outbox table, rendered by its database's [`sealed::Dialect`].
// `pub` in a private module, as the sealed trait needs, yet unnameable outside the crate.
pub struct Statements {
    /// The table; PostgreSQL's `migrate` takes its advisory lock on the name.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) table: TableName,
    /// The DDL, one item per statement `migrate` sends (PostgreSQL and MySQL have one).
    pub(crate) schema: Vec<String>,
    /// Binds `id, topic, payload, ordering_key`, then the channel if there is one.
    pub(crate) enqueue: SqlStr,
    /// The `NOTIFY` channel (PostgreSQL), bound last by `enqueue`.
    pub(crate) channel: Option<String>,
    /// Returns `seq, id, topic, payload, ordering_key, attempts` of due rows, locking or
    /// leasing them (the dialect's `bind_take` binds it).
    pub(crate) take: SqlStr,
    /// Marks rows sent; completed and bound by the dialect's `with_seqs`.
    pub(crate) mark: SqlStr,
    /// Ends the lease of rows whose publish failed (where `take` leases), like `mark`.
    pub(crate) release: Option<SqlStr>,
    /// Counts a refusal and sets the next attempt: binds the error, the delay, the `seq`.
    pub(crate) retry_later: SqlStr,
    /// Counts a refusal and parks the row: binds the error, the `seq`.
    pub(crate) park: SqlStr,
    pub(crate) purge: SqlStr,
    pub(crate) unsent: SqlStr,
    pub(crate) parked: ParkedStatements,
    /// The columns added since the table's first release, for tables created before.
    pub(crate) upgrades: Vec<AddedColumn>,
}

/// The statements about parked rows, the same on every database but for the placeholders.
pub(crate) struct ParkedStatements {
    /// Binds the row limit.
    pub(crate) list: SqlStr,
    pub(crate) count: SqlStr,
    /// Binds the event id.
    pub(crate) requeue: SqlStr,
    pub(crate) requeue_all: SqlStr,
}

impl Statements {
    /// The count of rows waiting to be sent, the same text on every database.
    pub(crate) fn unsent(table: &TableName) -> SqlStr {
        statement(format!(
            "SELECT count(*) FROM {} WHERE sent_at IS NULL AND parked_at IS NULL",
            table.as_str()
        ))
    }

    /// The statements about parked rows; `param(n)` is the dialect's n-th placeholder.
    pub(crate) fn parked(table: &TableName, param: fn(usize) -> String) -> ParkedStatements {
        let t = table.as_str();
        let parked = "parked_at IS NOT NULL AND sent_at IS NULL";
        // A re-queued row starts over: a full budget of attempts, due at once.
        let requeue = format!(
            "UPDATE {t} SET parked_at = NULL, attempts = 0, next_attempt_at = NULL WHERE {parked}"
        );
        ParkedStatements {
            list: statement(format!(
                "SELECT seq, id, topic, ordering_key, attempts, last_error FROM {t}
                 WHERE {parked} ORDER BY seq LIMIT {}",
                param(1)
            )),
            count: statement(format!("SELECT count(*) FROM {t} WHERE {parked}")),
            requeue: statement(format!("{requeue} AND id = {}", param(1))),
            requeue_all: statement(requeue),
        }
    }

    /// The columns the parking of refused rows added (PostgreSQL and MySQL spell them alike
    /// but for the time type), for tables created before.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn refusal_columns(
        table: &TableName,
        if_not_exists: &str,
        time: &str,
    ) -> Vec<AddedColumn> {
        let t = table.as_str();
        [
            ("attempts", "BIGINT NOT NULL DEFAULT 0"),
            ("last_error", "TEXT NULL"),
            ("next_attempt_at", time),
            ("parked_at", time),
        ]
        .into_iter()
        .map(|(name, kind)| AddedColumn {
            name,
            add: format!("ALTER TABLE {t} ADD COLUMN {if_not_exists}{name} {kind}"),
        })
        .collect()
    }
}

impl<DB: OutboxDatabase> Clone for SqlOutbox<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            sql: Arc::clone(&self.sql),
            refusals: self.refusals,
            publish_timeout: self.publish_timeout,
        }
    }
}

impl<DB: OutboxDatabase> SqlOutbox<DB> {
    /// How rows the broker refuses are retried and when they are parked (default:
    /// [`RefusalPolicy::default`]).
    pub fn refusals(mut self, policy: RefusalPolicy) -> Self {
        self.refusals = policy;
        self
    }

    /// How long one batch's publish may take, confirms included (default
    /// [`DEFAULT_PUBLISH_TIMEOUT`], 30 s): past it the batch fails as a whole (no row's
    /// attempt is spent) and is tried again. PostgreSQL and MySQL hold the batch's row locks
    /// that long at most; SQLite leases the rows for twice as long (the publish, then as much
    /// again to record the verdicts), after which a relay that died mid-batch has its rows
    /// taken again.
    pub fn publish_timeout(mut self, limit: Duration) -> Self {
        self.publish_timeout = limit;
        self
    }
}

impl<DB> SqlOutbox<DB>
where
    DB: OutboxDatabase,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    String: sqlx::Encode<'static, DB> + sqlx::Type<DB>,
    Vec<u8>: sqlx::Encode<'static, DB> + sqlx::Type<DB>,
    Option<String>: sqlx::Encode<'static, DB>,
{
    /// The outbox in table `tower_outbox`.
    pub fn new(pool: Pool<DB>) -> Self {
        Self::with_table(pool, DEFAULT_TABLE).expect("the default table name is valid")
    }

    /// The outbox in another table (optionally qualified: `schema.table` on PostgreSQL,
    /// `database.table` on MySQL).
    pub fn with_table(pool: Pool<DB>, table: &str) -> Result<Self, OutboxError> {
        let sql = DB::statements(TableName::new(table)?);
        Ok(Self {
            pool,
            sql: Arc::new(sql),
            refusals: RefusalPolicy::default(),
            publish_timeout: DEFAULT_PUBLISH_TIMEOUT,
        })
    }

    /// Writes `event` in the caller's transaction (pass `&mut tx` or `&mut *tx`, or any
    /// connection). It is published only if that transaction commits.
    pub async fn enqueue(
        &self,
        conn: &mut DB::Connection,
        event: &NewEvent,
    ) -> Result<(), OutboxError> {
        let mut query = sqlx::query(self.sql.enqueue.clone())
            .bind(&event.id)
            .bind(&event.topic)
            .bind(&event.payload)
            .bind(&event.key);
        if let Some(channel) = &self.sql.channel {
            query = query.bind(channel);
        }
        query.execute(conn).await?;
        Ok(())
    }
}

/// A refused row of a batch, recorded in the batch's transaction and reported after it.
struct Refused {
    /// Its place in the batch.
    index: usize,
    /// Its refusals, this one included.
    refusals: u32,
    parked: bool,
    error: String,
}

#[async_trait]
impl<DB> OutboxSource for SqlOutbox<DB>
where
    DB: OutboxDatabase,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'r> i64: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'static, DB>,
    String: sqlx::Encode<'static, DB>,
    for<'r> String: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> Vec<u8>: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> Option<String>: sqlx::Decode<'r, DB>,
    for<'c> &'c str: sqlx::ColumnIndex<DB::Row>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    async fn relay_batch(
        &self,
        publisher: &dyn Publisher,
        limit: u32,
    ) -> Result<usize, OutboxError> {
        let limit = limit.max(1);
        let settled = if DB::LEASES {
            self.relay_leased(publisher, limit).await?
        } else {
            self.relay_locked(publisher, limit).await?
        };
        let Some((batch, refused)) = settled else {
            return Ok(0);
        };
        for row in &refused {
            report(&batch, row);
        }
        Ok(batch.seqs.len())
    }

    async fn purge_sent(&self, older_than: Duration, limit: u32) -> Result<u64, OutboxError> {
        let query = sqlx::query(self.sql.purge.clone());
        Ok(DB::run_purge(&self.pool, query, older_than, limit.max(1)).await?)
    }

    async fn unsent(&self) -> Result<u64, OutboxError> {
        let n: i64 = sqlx::query_scalar(self.sql.unsent.clone())
            .fetch_one(&self.pool)
            .await?;
        Ok(count(n))
    }

    fn listen(&self, wake: Arc<tokio::sync::Notify>) -> Option<tokio::task::JoinHandle<()>> {
        DB::listen(&self.pool, &self.sql, wake)
    }
}

/// What a relay's batch did with its rows: `None` when none was due.
type Settled = Option<(Batch, Vec<Refused>)>;

impl<DB> SqlOutbox<DB>
where
    DB: OutboxDatabase,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'r> i64: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'static, DB>,
    String: sqlx::Encode<'static, DB>,
    for<'r> String: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> Vec<u8>: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> Option<String>: sqlx::Decode<'r, DB>,
    for<'c> &'c str: sqlx::ColumnIndex<DB::Row>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    /// One transaction: take the rows locked, publish, record the verdicts, commit.
    async fn relay_locked(
        &self,
        publisher: &dyn Publisher,
        limit: u32,
    ) -> Result<Settled, OutboxError> {
        let mut conn = self.pool.acquire().await?;
        let mut tx = begin::<DB>(&mut conn).await?;
        let rows = DB::bind_take(sqlx::query(self.sql.take.clone()), limit, Duration::ZERO)
            .fetch_all(&mut *tx)
            .await?;
        if rows.is_empty() {
            return Ok(None);
        }
        let batch = decode_batch(rows)?;
        // The rows stay locked across the publish, so other relays skip them instead of
        // publishing them too; the publish is bounded, so the locks are. A crash from here to
        // the commit leaves them due, and they are published again.
        let verdicts = self.publish(publisher, &batch).await?;
        let refused = self.settle(&mut tx, &batch, &verdicts).await?;
        tx.commit().await?;
        Ok(Some((batch, refused)))
    }

    /// Two short transactions with the publish between them, outside any: lease the rows,
    /// publish, record the verdicts. For SQLite, whose one write lock a transaction held
    /// across the publish would take from every producer for as long as the broker takes.
    async fn relay_leased(
        &self,
        publisher: &dyn Publisher,
        limit: u32,
    ) -> Result<Settled, OutboxError> {
        let lease = self.publish_timeout.saturating_mul(2);
        let rows = {
            let mut conn = self.pool.acquire().await?;
            let mut tx = begin::<DB>(&mut conn).await?;
            let rows = DB::bind_take(sqlx::query(self.sql.take.clone()), limit, lease)
                .fetch_all(&mut *tx)
                .await?;
            tx.commit().await?;
            rows
        };
        if rows.is_empty() {
            return Ok(None);
        }
        let batch = decode_batch(rows)?;
        // The lease keeps other relays off these rows, and a relay that dies here leaves
        // them until the lease ends; the publish ends (the time limit) well before that.
        let verdicts = match self.publish(publisher, &batch).await {
            Ok(verdicts) => verdicts,
            Err(error) => {
                self.release(&batch).await;
                return Err(error);
            }
        };
        let mut conn = self.pool.acquire().await?;
        let mut tx = begin::<DB>(&mut conn).await?;
        let refused = self.settle(&mut tx, &batch, &verdicts).await?;
        tx.commit().await?;
        Ok(Some((batch, refused)))
    }

    /// The broker's verdicts on `batch`, one per row, within the publish time limit.
    async fn publish(
        &self,
        publisher: &dyn Publisher,
        batch: &Batch,
    ) -> Result<Vec<Verdict>, OutboxError> {
        let call = publisher.publish_confirmed(&batch.messages);
        let verdicts = deadline("outbox", "publish a batch", self.publish_timeout, call).await?;
        // A publisher that answers for another number of messages broke its contract:
        // nothing is known, as after a broker error.
        if verdicts.len() != batch.messages.len() {
            return Err(OutboxError::Verdicts {
                messages: batch.messages.len(),
                verdicts: verdicts.len(),
            });
        }
        Ok(verdicts)
    }

    /// Records the verdicts in the caller's transaction: accepted rows sent, each refused row
    /// its attempt and next try, or parked.
    async fn settle(
        &self,
        conn: &mut DB::Connection,
        batch: &Batch,
        verdicts: &[Verdict],
    ) -> Result<Vec<Refused>, OutboxError> {
        let mut accepted = Vec::with_capacity(verdicts.len());
        let mut refused = Vec::new();
        for (index, verdict) in verdicts.iter().enumerate() {
            let seq = batch.seqs[index];
            let Err(refusal) = verdict else {
                accepted.push(seq);
                continue;
            };
            let refusals = batch.attempts[index].saturating_add(1);
            let parked = self.refusals.parks(refusals);
            let error = error_text(refusal);
            let query = if parked {
                sqlx::query(self.sql.park.clone()).bind(error.clone())
            } else {
                let query = sqlx::query(self.sql.retry_later.clone()).bind(error.clone());
                DB::bind_age(query, self.refusals.delay_after(refusals))
            };
            query.bind(seq).execute(&mut *conn).await?;
            refused.push(Refused {
                index,
                refusals,
                parked,
                error,
            });
        }
        if !accepted.is_empty() {
            DB::with_seqs(&self.sql.mark, accepted)
                .execute(&mut *conn)
                .await?;
        }
        Ok(refused)
    }

    /// Ends the lease of a batch whose publish failed, so the next batch takes its rows at
    /// once; if that fails too, the lease ends by itself.
    async fn release(&self, batch: &Batch) {
        let Some(release) = &self.sql.release else {
            return;
        };
        let released = async {
            let mut conn = self.pool.acquire().await?;
            let mut tx = begin::<DB>(&mut conn).await?;
            DB::with_seqs(release, batch.seqs.clone())
                .execute(&mut *tx)
                .await?;
            tx.commit().await
        };
        if let Err(error) = released.await {
            tracing::warn!(
                error = %error_chain(&error),
                "outbox: could not release the rows of a failed batch; they are taken again when their lease ends"
            );
        }
    }

    /// The parked rows in sequence order, at most `limit`.
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")]
    /// # async fn example(outbox: tower_idempotency::outbox::PgOutbox) -> Result<(), Box<dyn std::error::Error>> {
    /// for row in outbox.parked(100).await? {
    ///     println!("{} ({}): refused {} times, last: {:?}", row.id, row.topic, row.attempts, row.last_error);
    /// }
    /// // The broker takes their topic now (the queue is bound): back in line, all of them.
    /// let requeued = outbox.requeue_all_parked().await?;
    /// # Ok(()) }
    /// ```
    pub async fn parked(&self, limit: u32) -> Result<Vec<ParkedRow>, OutboxError> {
        let rows = sqlx::query(self.sql.parked.list.clone())
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?;
        let mut parked = Vec::with_capacity(rows.len());
        for row in rows {
            use sqlx::Row;
            let attempts: i64 = row.try_get("attempts")?;
            parked.push(ParkedRow {
                seq: row.try_get("seq")?,
                id: row.try_get("id")?,
                topic: row.try_get("topic")?,
                key: row.try_get("ordering_key")?,
                attempts: u32::try_from(attempts).unwrap_or(u32::MAX),
                last_error: row.try_get("last_error")?,
            });
        }
        Ok(parked)
    }

    /// How many rows are parked.
    pub async fn parked_count(&self) -> Result<u64, OutboxError> {
        let n: i64 = sqlx::query_scalar(self.sql.parked.count.clone())
            .fetch_one(&self.pool)
            .await?;
        Ok(count(n))
    }

    /// Puts the parked row of event `id` back in line with a full budget of attempts, due at
    /// once (after its cause was fixed: the queue bound, the stream created). Returns whether
    /// a parked row had that id.
    pub async fn requeue_parked(&self, id: &str) -> Result<bool, OutboxError> {
        let done = sqlx::query(self.sql.parked.requeue.clone())
            .bind(id.to_owned())
            .execute(&self.pool)
            .await?;
        Ok(DB::rows_affected(&done) > 0)
    }

    /// Puts every parked row back in line, like [`requeue_parked`](Self::requeue_parked);
    /// returns how many.
    pub async fn requeue_all_parked(&self) -> Result<u64, OutboxError> {
        let done = sqlx::query(self.sql.parked.requeue_all.clone())
            .execute(&self.pool)
            .await?;
        Ok(DB::rows_affected(&done))
    }
}

/// Begins a relay transaction on `conn` the dialect's way.
async fn begin<DB>(
    conn: &mut sqlx::pool::PoolConnection<DB>,
) -> Result<sqlx::Transaction<'_, DB>, sqlx::Error>
where
    DB: OutboxDatabase,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
{
    if let Some(setup) = DB::RELAY_SETUP {
        sqlx::query(setup).execute(&mut **conn).await?;
    }
    match DB::RELAY_BEGIN {
        Some(begin) => sqlx::Connection::begin_with(&mut **conn, begin).await,
        None => sqlx::Connection::begin(&mut **conn).await,
    }
}

/// One log line and the metric for a refused row, once its batch committed.
fn report(batch: &Batch, row: &Refused) {
    let message = &batch.messages[row.index];
    crate::metrics::outbox_refused(row.parked);
    if row.parked {
        tracing::warn!(
            event_id = %message.id,
            topic = %message.topic,
            attempts = row.refusals,
            error = %row.error,
            "outbox: the broker refused this row too often; it is parked and the rows after it \
             are sent. Re-queue it (requeue_parked) once the broker takes its topic"
        );
    } else {
        tracing::info!(
            event_id = %message.id,
            topic = %message.topic,
            attempts = row.refusals,
            error = %row.error,
            "outbox: the broker refused this row; it is tried again later"
        );
    }
}

/// `with_seqs` for the dialects without arrays (MySQL, SQLite): `<prefix>(?, ?, ...)`, one
/// placeholder per row, each bound to its sequence number.
fn with_each_seq<DB>(prefix: &SqlStr, seqs: Vec<i64>) -> Query<DB>
where
    DB: Database,
    i64: sqlx::Encode<'static, DB> + sqlx::Type<DB>,
{
    let statement = super::with_placeholders(prefix.as_str(), seqs.len());
    let mut query = sqlx::query(sqlx::AssertSqlSafe(statement));
    for seq in seqs {
        query = query.bind(seq);
    }
    query
}
