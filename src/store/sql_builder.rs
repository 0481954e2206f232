//! The one builder of the SQL stores: the table is the only choice, and it is checked once,
//! by `build`.

use std::fmt;

use crate::sql::{InvalidIdentifier, TableName};

/// Builds a SQL store ([`PostgresStore`](super::PostgresStore),
/// [`MySqlStore`](super::MySqlStore), [`SqliteStore`](super::SqliteStore)) with a table
/// name other than the default. Setters never fail; [`build`](Self::build) validates.
///
/// ```
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_idempotency::store::SqliteStore;
///
/// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
/// let store = SqliteStore::builder(pool.clone()).table("idempotency").build()?;
/// assert_eq!(store.table().as_str(), "idempotency");
///
/// let refused = SqliteStore::builder(pool).table("records; DROP TABLE users").build();
/// assert!(refused.is_err());
/// # Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
/// ```
pub struct SqlStoreBuilder<S: SqlStore> {
    pool: S::Pool,
    table: String,
    /// What only this database offers (PostgreSQL: whether completions notify waiters in
    /// other processes; `()` elsewhere), so a builder carries no setting its store ignores.
    options: S::Options,
}

/// A store [`SqlStoreBuilder`] builds. Implemented by this crate's SQL stores only.
pub trait SqlStore: sealed::Assemble {}

pub(crate) mod sealed {
    use crate::sql::TableName;

    /// How a SQL store is put together from its pool and its validated table.
    pub trait Assemble: Sized {
        /// The sqlx pool the store runs on.
        type Pool: Clone + std::fmt::Debug;
        /// Settings only this database has, set by its own builder methods; `()` for none.
        type Options: Clone + Default + std::fmt::Debug;
        /// The table used unless the builder names another.
        const DEFAULT_TABLE: &'static str;
        /// The store on `pool`, its statements rendered for `table`, with its own `options`.
        fn assemble(pool: Self::Pool, table: TableName, options: Self::Options) -> Self;
    }
}

impl<S: SqlStore> SqlStoreBuilder<S> {
    pub(crate) fn new(pool: S::Pool) -> Self {
        Self {
            pool,
            table: S::DEFAULT_TABLE.to_owned(),
            options: S::Options::default(),
        }
    }

    /// The database's own settings, for its builder methods.
    #[cfg(feature = "postgres")]
    pub(crate) fn options_mut(&mut self) -> &mut S::Options {
        &mut self.options
    }

    /// The table to use, optionally qualified (`schema.table`; on MySQL `database.table`, on
    /// SQLite a table in an attached database). It is validated by [`build`](Self::build): see
    /// [`TableName`] for what is accepted.
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = name.into();
        self
    }

    /// Builds the store, or says why the table name was refused. It does not touch the
    /// database: call the store's `migrate` (or run its `schema_sql` yourself) before using it.
    pub fn build(self) -> Result<S, InvalidIdentifier> {
        Ok(S::assemble(
            self.pool,
            TableName::new(self.table)?,
            self.options,
        ))
    }
}

impl<S: SqlStore> Clone for SqlStoreBuilder<S> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            table: self.table.clone(),
            options: self.options.clone(),
        }
    }
}

impl<S: SqlStore> fmt::Debug for SqlStoreBuilder<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlStoreBuilder")
            .field("pool", &self.pool)
            .field("table", &self.table)
            .field("options", &self.options)
            .finish()
    }
}
