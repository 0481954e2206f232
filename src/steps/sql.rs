//! The one SQL journal: [`SqlJournal`] runs statements each database renders once (its own
//! file: `postgres.rs`, `mysql.rs`, `sqlite.rs`), and the local phase of [`Steps`].

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use serde::{de::DeserializeOwned, Serialize};
use sqlx::{Executor, IntoArguments, Pool, Row, SqlStr};

use super::{handle::encode, Journal, KeyOwner, Orphan, StepError, Steps};
use crate::{
    record::{Fingerprint, StoreKey},
    sql::{self, InvalidIdentifier, TableName},
    store::StoreError,
};

/// The journal table the SQL stores use unless told otherwise.
pub const DEFAULT_TABLE: &str = "tower_idempotency_steps";

/// A journal of steps in a table of the database that holds the store's records; use it by
/// its names `PostgresJournal`, `MySqlJournal` and `SqliteJournal` (each behind its feature).
/// Clones share the pool.
///
/// An entry is appended in a transaction that first reads the key's record under the claim's
/// token and locks it (PostgreSQL `FOR SHARE`; MySQL / MariaDB `LOCK IN SHARE MODE`; SQLite
/// takes the database's one write lock with `BEGIN IMMEDIATE`): a takeover of the key waits for the entry's commit, or the entry is
/// refused. A local phase's writes go in that same transaction.
///
/// That lock also holds back the claim's own lease renewals until the phase commits: keep a
/// local phase well within the lease. One that outlasts it stays safe (a takeover still waits
/// for its commit), but the owner loses the key and its next step is refused.
pub struct SqlJournal<DB: JournalDatabase> {
    pool: Pool<DB>,
    sql: Arc<Statements>,
}

/// A database [`SqlJournal`] runs on. Implemented by this crate only.
pub trait JournalDatabase: sealed::Dialect {}

impl<DB: sealed::Dialect> JournalDatabase for DB {}

pub(crate) mod sealed {
    use super::Statements;
    use crate::sql::TableName;

    /// What differs between databases: the SQL text and how a step's transaction begins.
    pub trait Dialect: sqlx::Database {
        /// The statement that begins a step's transaction; `None`: sqlx's `BEGIN`.
        const BEGIN: Option<&'static str> = None;
        /// The database's name in errors.
        const BACKEND: &'static str;

        /// How many rows a statement touched (sqlx has no generic accessor).
        fn rows_affected(done: &Self::QueryResult) -> u64;

        /// The statements for journal table `journal` beside records table `records`.
        fn statements(journal: TableName, records: &TableName) -> Statements;
    }

    /// A SQL store a journal is kept beside: its pool, and the records table that fences
    /// the journal's entries.
    pub trait Beside {
        /// The store's database.
        type Database: Dialect;
        /// The store's pool.
        fn pool(&self) -> &sqlx::Pool<Self::Database>;
        /// The store's records table.
        fn records(&self) -> &TableName;
    }
}

/// The statements of one journal table, rendered by its database's dialect.
// `pub` in a private module, as the sealed trait needs, yet unnameable outside the crate.
pub struct Statements {
    pub(crate) table: TableName,
    /// The DDL, one item per statement.
    pub(crate) schema: Vec<String>,
    /// Binds scope, key, token; returns a row only while the claim holds the token, and
    /// locks the record against a takeover until the transaction ends.
    pub(crate) fence: SqlStr,
    /// Binds scope, key, step, fingerprint, output, retention (ms).
    pub(crate) append: SqlStr,
    /// Binds scope, key, fingerprint; returns step, output of live entries.
    pub(crate) entries: SqlStr,
    /// Binds the batch size.
    pub(crate) purge: SqlStr,
    /// Binds the started step, the failed step, the limit; returns scope, key, fingerprint,
    /// output (see [`Journal::orphans`]).
    pub(crate) orphans: SqlStr,
}

impl<DB: JournalDatabase> Clone for SqlJournal<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            sql: Arc::clone(&self.sql),
        }
    }
}

impl<DB: JournalDatabase> std::fmt::Debug for SqlJournal<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlJournal")
            .field("table", &self.sql.table)
            .finish_non_exhaustive()
    }
}

impl<DB: JournalDatabase> SqlJournal<DB> {
    /// The journal in table [`DEFAULT_TABLE`], beside `store`'s records.
    pub fn for_store<S: sealed::Beside<Database = DB>>(store: &S) -> Self {
        Self::with_table(store, DEFAULT_TABLE).expect("the default table name is valid")
    }

    /// The journal in table `table` (PostgreSQL: optionally `schema.table`), beside `store`'s
    /// records.
    pub fn with_table<S: sealed::Beside<Database = DB>>(
        store: &S,
        table: &str,
    ) -> Result<Self, InvalidIdentifier> {
        Ok(Self {
            pool: store.pool().clone(),
            sql: Arc::new(DB::statements(TableName::new(table)?, store.records())),
        })
    }

    /// The DDL `migrate` runs, one statement per item: paste it into your own migrations if
    /// you prefer to run those.
    pub fn schema_sql(&self) -> &[String] {
        &self.sql.schema
    }

    /// The journal's table.
    pub fn table(&self) -> &TableName {
        &self.sql.table
    }

    /// The pool the journal runs on.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }
}

fn backend<DB: JournalDatabase>(error: sqlx::Error) -> StoreError {
    sql::backend(DB::BACKEND, error)
}

impl<DB> SqlJournal<DB>
where
    DB: JournalDatabase,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    String: sqlx::Encode<'static, DB> + sqlx::Type<DB>,
    Vec<u8>: sqlx::Encode<'static, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'static, DB> + sqlx::Type<DB>,
{
    async fn begin(&self) -> Result<sqlx::Transaction<'static, DB>, StoreError> {
        match DB::BEGIN {
            Some(begin) => self.pool.begin_with(begin).await,
            None => self.pool.begin().await,
        }
        .map_err(backend::<DB>)
    }

    /// Checks and locks the claim inside `conn`'s transaction: [`StoreError::StaleToken`]
    /// unless the record is in progress under `owner`'s token.
    async fn fence(&self, conn: &mut DB::Connection, owner: &KeyOwner) -> Result<(), StoreError> {
        let held = sqlx::query(self.sql.fence.clone())
            .bind(owner.key.scope().to_owned())
            .bind(owner.key.key().to_owned())
            .bind(owner.token.to_bytes().to_vec())
            .fetch_optional(&mut *conn)
            .await
            .map_err(backend::<DB>)?;
        match held {
            Some(_) => Ok(()),
            None => Err(StoreError::StaleToken),
        }
    }

    async fn write(
        &self,
        conn: &mut DB::Connection,
        owner: &KeyOwner,
        step: &str,
        output: Bytes,
    ) -> Result<(), StoreError> {
        sqlx::query(self.sql.append.clone())
            .bind(owner.key.scope().to_owned())
            .bind(owner.key.key().to_owned())
            .bind(step.to_owned())
            .bind(owner.fingerprint.as_bytes().to_vec())
            .bind(output.to_vec())
            .bind(sql::millis(owner.retention)?)
            .execute(&mut *conn)
            .await
            .map_err(backend::<DB>)?;
        Ok(())
    }

    /// Commits a step's transaction: a broken connection during the `COMMIT` leaves the
    /// outcome unknown (the next attempt reads the journal and learns it).
    async fn commit(tx: sqlx::Transaction<'static, DB>) -> Result<(), StoreError> {
        tx.commit().await.map_err(|source| {
            if matches!(source, sqlx::Error::Database(_)) {
                backend::<DB>(source)
            } else {
                StoreError::CommitOutcomeUnknown {
                    backend: DB::BACKEND,
                    source: source.into(),
                }
            }
        })
    }
}

#[async_trait]
impl<DB> Journal for SqlJournal<DB>
where
    DB: JournalDatabase,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    String: sqlx::Encode<'static, DB> + sqlx::Type<DB>,
    Vec<u8>: sqlx::Encode<'static, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'static, DB> + sqlx::Type<DB>,
    for<'r> String: sqlx::Decode<'r, DB>,
    for<'r> Vec<u8>: sqlx::Decode<'r, DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    async fn entries(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        let rows = sqlx::query(self.sql.entries.clone())
            .bind(key.scope().to_owned())
            .bind(key.key().to_owned())
            .bind(fingerprint.as_bytes().to_vec())
            .fetch_all(&self.pool)
            .await
            .map_err(backend::<DB>)?;
        rows.iter()
            .map(|row| {
                let step: String = row.try_get(0usize).map_err(backend::<DB>)?;
                let output: Vec<u8> = row.try_get(1usize).map_err(backend::<DB>)?;
                Ok((step, Bytes::from(output)))
            })
            .collect()
    }

    async fn append(&self, owner: &KeyOwner, step: &str, output: Bytes) -> Result<(), StoreError> {
        let mut tx = self.begin().await?;
        self.fence(&mut tx, owner).await?;
        self.write(&mut tx, owner, step, output).await?;
        Self::commit(tx).await
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let done = sqlx::query(self.sql.purge.clone())
            .bind(i64::from(batch))
            .execute(&self.pool)
            .await
            .map_err(backend::<DB>)?;
        Ok(DB::rows_affected(&done))
    }

    async fn orphans(
        &self,
        started: &str,
        failed: &str,
        limit: u32,
    ) -> Result<Vec<Orphan>, StoreError> {
        let rows = sqlx::query(self.sql.orphans.clone())
            .bind(started.to_owned())
            .bind(failed.to_owned())
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(backend::<DB>)?;
        rows.iter()
            .map(|row| {
                let get_text = |i: usize| row.try_get::<String, _>(i).map_err(backend::<DB>);
                let fingerprint: Vec<u8> = row.try_get(2usize).map_err(backend::<DB>)?;
                let output: Vec<u8> = row.try_get(3usize).map_err(backend::<DB>)?;
                Ok(Orphan {
                    key: StoreKey::new(get_text(0)?, get_text(1)?),
                    fingerprint: sql::decode_fingerprint(DB::BACKEND, &fingerprint)?,
                    output: Bytes::from(output),
                })
            })
            .collect()
    }
}

impl<DB> Steps<SqlJournal<DB>>
where
    DB: JournalDatabase,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    String: sqlx::Encode<'static, DB> + sqlx::Type<DB>,
    Vec<u8>: sqlx::Encode<'static, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'static, DB> + sqlx::Type<DB>,
    for<'r> String: sqlx::Decode<'r, DB>,
    for<'r> Vec<u8>: sqlx::Decode<'r, DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    /// A local phase: `phase` writes in the journal's database, in a transaction that also
    /// journals its output and commits only while the claim still holds its token. Either the
    /// writes and the entry commit together, or neither does (a failing phase, a lost claim,
    /// a crash). If an earlier attempt finished the step, its output is returned and `phase`
    /// does not run.
    ///
    /// `phase` gets the transaction's connection; write with `.execute(&mut *conn)`. It must
    /// not commit: the transaction is the step's. Boxing its future is what lets it borrow the
    /// connection: `|conn| Box::pin(async move { .. })`.
    pub async fn local<T, E, F>(&self, step: &str, phase: F) -> Result<T, StepError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: for<'c> FnOnce(&'c mut DB::Connection) -> BoxFuture<'c, Result<T, E>>,
    {
        if let Some(output) = self.journaled(step)? {
            return Ok(output);
        }
        let (journal, owner) = (self.journal(), self.owner());
        let journal_error = |e| StepError::journal(step, e);
        let mut tx = journal.begin().await.map_err(journal_error)?;
        // First: from here a takeover of the key waits for this transaction.
        journal.fence(&mut tx, owner).await.map_err(journal_error)?;
        // On an error the transaction is dropped, which rolls the phase's writes back.
        let output = phase(&mut tx).await.map_err(|source| StepError::Step {
            step: step.to_owned(),
            source,
        })?;
        let bytes = encode(step, &output)?;
        journal
            .write(&mut tx, owner, step, bytes.clone())
            .await
            .map_err(journal_error)?;
        SqlJournal::commit(tx).await.map_err(journal_error)?;
        self.remember(step, bytes);
        Ok(output)
    }
}
