use std::future::Future;

use sqlx::{Acquire, Encode, FromRow, Transaction, Type};

use super::{
    backend::conflict_reason, ColumnName, ConflictReason, Expected, InsertOutcome, SetValues,
    Version, VersionedBackend, VersionedTableError, VersionedUpdate,
};
use crate::sql::TableName;

/// Decodes the caller's row type from a database row.
type Decode<DB, R> = fn(&<DB as sqlx::Database>::Row) -> Result<R, sqlx::Error>;

/// A table with an id column and a version column, updated by compare-and-set.
///
/// The version column must be `BIGINT NOT NULL` (SQLite: `INTEGER NOT NULL`), the id column
/// unique (usually the primary key). Every write goes through one statement whose WHERE
/// clause carries the expected version and whose SET raises the version, so two writers
/// holding the same version can never both succeed.
///
/// All methods take anything sqlx can acquire a connection from: `&pool`, `&mut conn`,
/// `&mut *tx` (or `&mut tx`).
///
/// ```no_run
/// # #[cfg(feature = "postgres")]
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use tower_idempotency::version::{Version, VersionedTable, VersionedUpdate};
/// let payments = VersionedTable::new("payments", "id", "version")?;
/// let mut tx = pool.begin().await?;
/// let outcome = payments
///     .update_if_version(&mut *tx, "pay_1", Version::new(3), |set| {
///         set.value("status", "paid");
///     })
///     .await?;
/// match outcome {
///     VersionedUpdate::Updated { version, .. } => println!("now at {version}"),
///     VersionedUpdate::Conflict { current_version, .. } => println!("lost; at {current_version:?}"),
///     VersionedUpdate::NotFound => println!("no such payment"),
/// }
/// tower_idempotency::version::commit_if_updated(tx, outcome).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionedTable {
    table: TableName,
    id: ColumnName,
    version: ColumnName,
}

impl VersionedTable {
    /// Validates the table name (optionally `schema.table`) and the two column names.
    pub fn new(
        table: &str,
        id_column: &str,
        version_column: &str,
    ) -> Result<Self, VersionedTableError> {
        let invalid = |role| move |source| VersionedTableError::InvalidIdentifier { role, source };
        let table = TableName::new(table).map_err(invalid("table"))?;
        let id = ColumnName::new(id_column).map_err(invalid("id column"))?;
        let version = ColumnName::new(version_column).map_err(invalid("version column"))?;
        if id == version {
            return Err(VersionedTableError::ReservedColumn {
                column: version.to_string(),
                role: "id column as well as its version column",
            });
        }
        Ok(Self { table, id, version })
    }

    /// The table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// The id column.
    pub fn id_column(&self) -> &ColumnName {
        &self.id
    }

    /// The version column.
    pub fn version_column(&self) -> &ColumnName {
        &self.version
    }

    /// Sets the values given to `set` and raises the version by one, in one UPDATE whose
    /// WHERE clause selects row `id` at a version `expected` accepts. Nothing is read first.
    ///
    /// Only when that UPDATE matched no row does a second statement read the row by id, to
    /// tell [`Conflict`](VersionedUpdate::Conflict) (it exists, at the version reported)
    /// from [`NotFound`](VersionedUpdate::NotFound). A serialization failure or deadlock
    /// reported by the database is a `Conflict` too (with no current version: the
    /// transaction is aborted and must be rolled back).
    ///
    /// Per database:
    /// - PostgreSQL, SQLite: `UPDATE .. RETURNING` hands back the new version (and row).
    ///   A PostgreSQL REPEATABLE READ / SERIALIZABLE transaction that meets a concurrent
    ///   change gets SQLSTATE 40001 from the UPDATE: a `Conflict` with no current version.
    ///   A SQLite transaction whose snapshot went stale gets `SQLITE_BUSY(_SNAPSHOT)`: the
    ///   same.
    /// - MySQL / MariaDB: the version is raised as `LAST_INSERT_ID(version + 1)` so the new
    ///   version comes back with the statement's result. This overwrites the connection's
    ///   `LAST_INSERT_ID()`: read that before the update if you need it. The follow-up read
    ///   after zero rows is `LOCK IN SHARE MODE`, because a plain read in a REPEATABLE READ
    ///   transaction would show the old snapshot; inside your transaction it keeps a shared
    ///   lock on the row until you commit or roll back.
    pub fn update_if_version<'a, 'c, DB, A, K>(
        &'a self,
        conn: A,
        id: K,
        expected: impl Into<Expected>,
        set: impl FnOnce(&mut SetValues<'a, DB>),
    ) -> impl Future<Output = Result<VersionedUpdate, VersionedTableError>> + Send + 'a
    where
        DB: VersionedBackend,
        A: Acquire<'c, Database = DB> + Send + 'a,
        K: 'a + Encode<'a, DB> + Type<DB> + Clone + Send,
    {
        let values = self.values(set);
        let expected = expected.into();
        async move {
            let mut conn = acquire::<DB, A>(conn, "update").await?;
            self.update::<DB, K, ()>(&mut *conn, id, expected, values?, None)
                .await
        }
    }

    /// Like [`update_if_version`](Self::update_if_version), and also returns rows: the
    /// updated row on success (PostgreSQL and SQLite through `RETURNING *`; MySQL by reading
    /// it back in the same connection, `None` if another writer changed it in between), the
    /// current row on a version conflict.
    pub fn update_if_version_returning<'a, 'c, DB, A, K, R>(
        &'a self,
        conn: A,
        id: K,
        expected: impl Into<Expected>,
        set: impl FnOnce(&mut SetValues<'a, DB>),
    ) -> impl Future<Output = Result<VersionedUpdate<R>, VersionedTableError>> + Send + 'a
    where
        DB: VersionedBackend,
        A: Acquire<'c, Database = DB> + Send + 'a,
        K: 'a + Encode<'a, DB> + Type<DB> + Clone + Send,
        R: for<'r> FromRow<'r, DB::Row> + Send + Unpin + 'a,
    {
        let values = self.values(set);
        let expected = expected.into();
        let decode: Decode<DB, R> = |row| R::from_row(row);
        async move {
            let mut conn = acquire::<DB, A>(conn, "update").await?;
            self.update(&mut *conn, id, expected, values?, Some(decode))
                .await
        }
    }

    /// Inserts row `id` with the values given to `set` at [`Version::INITIAL`], unless a row
    /// with that id exists: a create-only write (`If-None-Match: *`). The unique constraint
    /// decides, in the INSERT itself (`is_unique_violation()`), so there is no read first
    /// and two concurrent creators cannot both win.
    ///
    /// On PostgreSQL a unique violation aborts the surrounding transaction; insert in a
    /// savepoint (`tx.begin()`) when the transaction has to continue after "already exists".
    pub fn insert_new<'a, 'c, DB, A, K>(
        &'a self,
        conn: A,
        id: K,
        set: impl FnOnce(&mut SetValues<'a, DB>),
    ) -> impl Future<Output = Result<InsertOutcome, VersionedTableError>> + Send + 'a
    where
        DB: VersionedBackend,
        A: Acquire<'c, Database = DB> + Send + 'a,
        K: 'a + Encode<'a, DB> + Type<DB> + Send,
    {
        let values = self.values(set);
        async move {
            let mut conn = acquire::<DB, A>(conn, "insert").await?;
            self.insert(&mut *conn, id, values?).await
        }
    }

    async fn insert<'args, DB, K>(
        &self,
        conn: &mut DB::Connection,
        id: K,
        mut values: SetValues<'args, DB>,
    ) -> Result<InsertOutcome, VersionedTableError>
    where
        DB: VersionedBackend,
        K: 'args + Encode<'args, DB> + Type<DB>,
    {
        let id_placeholder = values.bind(id).map_err(|e| self.bind_error(&self.id, e))?;
        let version_placeholder = values
            .bind_i64(Version::INITIAL.get())
            .map_err(|e| self.bind_error(&self.version, e))?;
        let (mut columns, mut placeholders) = (String::new(), String::new());
        for (column, placeholder) in &values.columns {
            columns.push_str(&format!("{column}, "));
            placeholders.push_str(&format!("{placeholder}, "));
        }
        let sql = format!(
            "INSERT INTO {table} ({columns}{id}, {version}) VALUES ({placeholders}{id_placeholder}, {version_placeholder})",
            table = self.table,
            id = self.id,
            version = self.version,
        );
        match DB::execute(conn, sql, values.args).await {
            Ok(_) => Ok(InsertOutcome::Created {
                version: Version::INITIAL,
            }),
            Err(error) => match error.as_database_error() {
                Some(db) if db.is_unique_violation() => Ok(InsertOutcome::AlreadyExists {
                    constraint: db.constraint().map(str::to_owned),
                }),
                _ => Err(database::<DB>("insert", error)),
            },
        }
    }

    /// The current version of row `id`, `None` if there is none (for an ETag on GET).
    pub fn current_version<'a, 'c, DB, A, K>(
        &'a self,
        conn: A,
        id: K,
    ) -> impl Future<Output = Result<Option<Version>, VersionedTableError>> + Send + 'a
    where
        DB: VersionedBackend,
        A: Acquire<'c, Database = DB> + Send + 'a,
        K: 'a + Encode<'a, DB> + Type<DB> + Send,
    {
        async move {
            let mut conn = acquire::<DB, A>(conn, "read").await?;
            let row = self.read::<DB, K>(&mut *conn, id, false, "").await?;
            row.map(|row| self.version_of::<DB>(&row)).transpose()
        }
    }

    /// Row `id` with its version, `None` if there is none (read the row and its ETag).
    pub fn fetch<'a, 'c, DB, A, K, R>(
        &'a self,
        conn: A,
        id: K,
    ) -> impl Future<Output = Result<Option<(Version, R)>, VersionedTableError>> + Send + 'a
    where
        DB: VersionedBackend,
        A: Acquire<'c, Database = DB> + Send + 'a,
        K: 'a + Encode<'a, DB> + Type<DB> + Send,
        R: for<'r> FromRow<'r, DB::Row> + Send + Unpin + 'a,
    {
        async move {
            let mut conn = acquire::<DB, A>(conn, "read").await?;
            let Some(row) = self.read::<DB, K>(&mut *conn, id, true, "").await? else {
                return Ok(None);
            };
            let version = self.version_of::<DB>(&row)?;
            let value = R::from_row(&row).map_err(|e| database::<DB>("read", e))?;
            Ok(Some((version, value)))
        }
    }

    /// Runs the caller's `set` closure (synchronously, before any I/O).
    fn values<'args, DB: VersionedBackend>(
        &self,
        set: impl FnOnce(&mut SetValues<'args, DB>),
    ) -> Result<SetValues<'args, DB>, VersionedTableError> {
        let mut values = SetValues::<DB>::new(&self.id, &self.version);
        set(&mut values);
        match values.error.take() {
            Some(error) => Err(error),
            None => Ok(values),
        }
    }

    async fn update<'args, DB, K, R>(
        &self,
        conn: &mut DB::Connection,
        id: K,
        expected: Expected,
        mut values: SetValues<'args, DB>,
        decode: Option<Decode<DB, R>>,
    ) -> Result<VersionedUpdate<R>, VersionedTableError>
    where
        DB: VersionedBackend,
        K: 'args + Encode<'args, DB> + Type<DB> + Clone,
    {
        // An expectation no version meets (`If-Match` with only weak tags, `If-None-Match:
        // *`) cannot update anything: skip straight to telling conflict from not found.
        if !expected.accepts_none() {
            let sql = self.update_sql(&mut values, id.clone(), &expected, decode.is_some())?;
            let won = if DB::RETURNING {
                match DB::fetch_optional(conn, sql, values.args).await {
                    Ok(Some(row)) => Some((
                        self.version_of::<DB>(&row)?,
                        decode_row::<DB, R>(decode, &row)?,
                    )),
                    Ok(None) => None,
                    Err(error) => return aborted::<DB, R>("update", error),
                }
            } else {
                match DB::execute(conn, sql, values.args).await {
                    // The statement always changes the version column, so every matched row
                    // is a changed row: the affected-rows count means "matched" whether or
                    // not the connection set CLIENT_FOUND_ROWS (sqlx does). A no-op update
                    // (same values) therefore still counts as 1, never as a lost race.
                    Ok(done) if done.rows_affected > 0 => {
                        let version = i64::try_from(done.last_insert_id)
                            .map(Version::new)
                            .map_err(|_| self.version_overflow(done.last_insert_id))?;
                        let row = match decode {
                            Some(_) => {
                                self.read_back::<DB, K, R>(conn, id.clone(), version, decode)
                                    .await?
                            }
                            None => None,
                        };
                        Some((version, row))
                    }
                    Ok(_) => None,
                    Err(error) => return aborted::<DB, R>("update", error),
                }
            };
            if let Some((version, row)) = won {
                return Ok(VersionedUpdate::Updated { version, row });
            }
        }
        // Zero rows matched: only now read, to tell a lost race from a missing row.
        let row = match self
            .read::<DB, K>(conn, id, decode.is_some(), DB::LOCKING_READ)
            .await
        {
            Ok(row) => row,
            Err(VersionedTableError::Database { source, .. })
                if conflict_reason::<DB>(&source).is_some() =>
            {
                return aborted::<DB, R>("read", source)
            }
            Err(error) => return Err(error),
        };
        match row {
            None => Ok(VersionedUpdate::NotFound),
            Some(row) => Ok(VersionedUpdate::Conflict {
                current_version: Some(self.version_of::<DB>(&row)?),
                row: decode_row::<DB, R>(decode, &row)?,
                reason: ConflictReason::VersionMismatch,
            }),
        }
    }

    fn update_sql<'args, DB, K>(
        &self,
        values: &mut SetValues<'args, DB>,
        id: K,
        expected: &Expected,
        returning_row: bool,
    ) -> Result<String, VersionedTableError>
    where
        DB: VersionedBackend,
        K: 'args + Encode<'args, DB> + Type<DB>,
    {
        let mut sql = format!("UPDATE {} SET ", self.table);
        for (column, placeholder) in &values.columns {
            sql.push_str(&format!("{column} = {placeholder}, "));
        }
        let id_placeholder = values.bind(id).map_err(|e| self.bind_error(&self.id, e))?;
        sql.push_str(&format!(
            "{version} = {bump} WHERE {id} = {id_placeholder}",
            version = self.version,
            bump = DB::bump(self.version.as_str()),
            id = self.id,
        ));
        if let Some(allowed) = expected.allowed() {
            sql.push_str(&format!(" AND {} IN (", self.version));
            self.push_versions(&mut sql, values, allowed)?;
        }
        if !expected.refused().is_empty() {
            sql.push_str(&format!(" AND {} NOT IN (", self.version));
            self.push_versions(&mut sql, values, expected.refused())?;
        }
        if DB::RETURNING {
            let columns = if returning_row {
                "*"
            } else {
                self.version.as_str()
            };
            sql.push_str(&format!(" RETURNING {columns}"));
        }
        Ok(sql)
    }

    fn push_versions<DB: VersionedBackend>(
        &self,
        sql: &mut String,
        values: &mut SetValues<'_, DB>,
        versions: &[Version],
    ) -> Result<(), VersionedTableError> {
        for (n, version) in versions.iter().enumerate() {
            let placeholder = values
                .bind_i64(version.get())
                .map_err(|e| self.bind_error(&self.version, e))?;
            sql.push_str(if n == 0 { "" } else { ", " });
            sql.push_str(&placeholder);
        }
        sql.push(')');
        Ok(())
    }

    async fn read<'args, DB, K>(
        &self,
        conn: &mut DB::Connection,
        id: K,
        whole_row: bool,
        suffix: &str,
    ) -> Result<Option<DB::Row>, VersionedTableError>
    where
        DB: VersionedBackend,
        K: 'args + Encode<'args, DB> + Type<DB>,
    {
        let mut values = SetValues::<DB>::new(&self.id, &self.version);
        let placeholder = values.bind(id).map_err(|e| self.bind_error(&self.id, e))?;
        let columns = if whole_row {
            "*"
        } else {
            self.version.as_str()
        };
        let sql = format!(
            "SELECT {columns} FROM {} WHERE {} = {placeholder}{suffix}",
            self.table, self.id
        );
        DB::fetch_optional(conn, sql, values.args)
            .await
            .map_err(|e| database::<DB>("read", e))
    }

    /// MySQL only: the updated row, read back on the same connection; `None` if it is no
    /// longer at the version this update produced.
    async fn read_back<'args, DB, K, R>(
        &self,
        conn: &mut DB::Connection,
        id: K,
        version: Version,
        decode: Option<Decode<DB, R>>,
    ) -> Result<Option<R>, VersionedTableError>
    where
        DB: VersionedBackend,
        K: 'args + Encode<'args, DB> + Type<DB>,
    {
        match self.read::<DB, K>(conn, id, true, "").await? {
            Some(row) if self.version_of::<DB>(&row)? == version => {
                decode_row::<DB, R>(decode, &row)
            }
            _ => Ok(None),
        }
    }

    fn version_of<DB: VersionedBackend>(
        &self,
        row: &DB::Row,
    ) -> Result<Version, VersionedTableError> {
        DB::get_i64(row, self.version.as_str())
            .map(Version::new)
            .map_err(|source| VersionedTableError::VersionColumn {
                table: self.table.to_string(),
                column: self.version.to_string(),
                source,
            })
    }

    fn version_overflow(&self, value: u64) -> VersionedTableError {
        VersionedTableError::VersionColumn {
            table: self.table.to_string(),
            column: self.version.to_string(),
            source: sqlx::Error::Decode(format!("version {value} does not fit in a BIGINT").into()),
        }
    }

    fn bind_error(
        &self,
        column: &ColumnName,
        source: sqlx::error::BoxDynError,
    ) -> VersionedTableError {
        VersionedTableError::Bind {
            column: column.to_string(),
            source,
        }
    }
}

/// Commits `tx` if `outcome` is an update, rolls it back otherwise, and returns the
/// outcome. A serialization failure or deadlock reported by the COMMIT itself (PostgreSQL
/// SERIALIZABLE checks at commit time) turns the outcome into a
/// [`Conflict`](VersionedUpdate::Conflict), so that
/// [`retry_on_conflict`](crate::version::retry_on_conflict) runs the attempt again.
pub async fn commit_if_updated<DB: VersionedBackend, R>(
    tx: Transaction<'_, DB>,
    outcome: VersionedUpdate<R>,
) -> Result<VersionedUpdate<R>, VersionedTableError> {
    if !outcome.is_updated() {
        tx.rollback()
            .await
            .map_err(|e| database::<DB>("rollback", e))?;
        return Ok(outcome);
    }
    match tx.commit().await {
        Ok(()) => Ok(outcome),
        Err(error) => aborted::<DB, R>("commit", error),
    }
}

async fn acquire<'c, DB: VersionedBackend, A: Acquire<'c, Database = DB>>(
    conn: A,
    operation: &'static str,
) -> Result<A::Connection, VersionedTableError> {
    conn.acquire()
        .await
        .map_err(|e| database::<DB>(operation, e))
}

fn decode_row<DB: VersionedBackend, R>(
    decode: Option<Decode<DB, R>>,
    row: &DB::Row,
) -> Result<Option<R>, VersionedTableError> {
    decode
        .map(|decode| decode(row))
        .transpose()
        .map_err(|e| database::<DB>("read", e))
}

/// A database error: a conflict if the database aborted for concurrency reasons, otherwise
/// an error.
fn aborted<DB: VersionedBackend, R>(
    operation: &'static str,
    error: sqlx::Error,
) -> Result<VersionedUpdate<R>, VersionedTableError> {
    match conflict_reason::<DB>(&error) {
        Some(reason) => {
            tracing::debug!(%error, ?reason, "versioned {operation} aborted by the database; reporting a conflict");
            Ok(VersionedUpdate::Conflict {
                current_version: None,
                row: None,
                reason,
            })
        }
        None => Err(database::<DB>(operation, error)),
    }
}

fn database<DB: VersionedBackend>(
    operation: &'static str,
    source: sqlx::Error,
) -> VersionedTableError {
    VersionedTableError::Database {
        backend: <DB as sqlx::Database>::NAME,
        operation,
        source,
    }
}
