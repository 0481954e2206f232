//! What the crate's own tables beside the stores (the outbox and the inbox) do the same way
//! on each database: run a purge with its age and row limit bound, and run a schema of
//! several statements.

use std::{future::Future, time::Duration};

use sqlx::Database;

/// A statement with its parameters, bound as the dialect writes them.
pub(crate) type Query<DB> = sqlx::query::Query<'static, DB, <DB as Database>::Arguments>;

/// The per-database half of the outbox's and the inbox's dialects. Implemented by this crate
/// only (`pub` in a private module, as the sealed dialects that extend it need).
pub trait OwnTable: Database {
    /// Binds `age` as the next parameter, in the unit the statement's `now - ?` (or
    /// `now + ?`) counts in: PostgreSQL milliseconds (a float, times an interval), MySQL
    /// microseconds (`TIMESTAMPADD`), SQLite milliseconds (this crate's clock columns).
    fn bind_age(query: Query<Self>, age: Duration) -> Query<Self>;

    /// The rows a statement changed (sqlx has no trait for it).
    fn rows_affected(done: &Self::QueryResult) -> u64;

    /// Runs a `purge` statement on `pool` with its age and row limit bound: how many rows it
    /// deleted.
    fn run_purge(
        pool: &sqlx::Pool<Self>,
        query: Query<Self>,
        age: Duration,
        limit: u32,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;
}

/// Implements [`OwnTable`] for a database; `$age` turns a duration into the value its
/// statements bind, `$limit` the row limit.
macro_rules! own_table {
    ($feature:literal, $db:ty, |$a:ident| $age:expr, |$l:ident| $limit:expr) => {
        #[cfg(feature = $feature)]
        impl OwnTable for $db {
            fn bind_age(query: Query<Self>, $a: Duration) -> Query<Self> {
                query.bind($age)
            }

            fn rows_affected(done: &Self::QueryResult) -> u64 {
                done.rows_affected()
            }

            async fn run_purge(
                pool: &sqlx::Pool<Self>,
                query: Query<Self>,
                age: Duration,
                $l: u32,
            ) -> Result<u64, sqlx::Error> {
                let done = Self::bind_age(query, age)
                    .bind($limit)
                    .execute(pool)
                    .await?;
                Ok(Self::rows_affected(&done))
            }
        }
    };
}

own_table!(
    "postgres",
    sqlx::Postgres,
    |age| clamp(age.as_millis()) as f64,
    |limit| i64::from(limit)
);
own_table!(
    "mysql",
    sqlx::MySql,
    |age| clamp(age.as_micros()),
    |limit| limit
);
own_table!(
    "sqlite",
    sqlx::Sqlite,
    |age| clamp(age.as_millis()),
    |limit| limit
);

/// An age in the statement's unit; ages beyond `i64` (292 000 years in microseconds) mean
/// "everything".
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
fn clamp(n: u128) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Runs `schema` one autocommit statement after another (MySQL's one, SQLite's table and
/// index): on SQLite each waits for the write lock on its own, and `IF NOT EXISTS` makes a
/// concurrent repeat a no-op.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) async fn execute_each<DB>(
    pool: &sqlx::Pool<DB>,
    schema: &[String],
) -> Result<(), sqlx::Error>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
{
    use sqlx::Executor;
    for statement in schema {
        // `Executor::execute` returns a boxed `Send` future, so `migrate` stays spawnable.
        pool.execute(sqlx::query(sqlx::AssertSqlSafe(statement.as_str())))
            .await?;
    }
    Ok(())
}

/// A column added to one of the crate's own tables after the table's first release: tables
/// created since have it, older ones get it from `migrate`.
pub(crate) struct AddedColumn {
    /// The column's name, probed with `SELECT <name> FROM <table> WHERE 1 = 0`.
    pub(crate) name: &'static str,
    /// The statement that adds it (`ALTER TABLE .. ADD COLUMN ..`).
    pub(crate) add: String,
}

/// Adds each of `columns` that `table` lacks. A probe first, so every start after the upgrade
/// runs no DDL (which would take the table's exclusive lock and queue behind its writers); a
/// concurrent `migrate` that adds the same column first makes the `ALTER` fail, which the
/// probe after it forgives, on every database alike.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) async fn add_columns<DB>(
    pool: &sqlx::Pool<DB>,
    table: &str,
    columns: &[AddedColumn],
) -> Result<(), sqlx::Error>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
{
    use sqlx::Executor;
    for column in columns {
        let probe = format!("SELECT {} FROM {table} WHERE 1 = 0", column.name);
        let present = |pool: &sqlx::Pool<DB>| {
            let probe = sqlx::query(sqlx::AssertSqlSafe(probe.clone()));
            let pool = pool.clone();
            async move { pool.execute(probe).await.is_ok() }
        };
        if present(pool).await {
            continue;
        }
        let added = pool
            .execute(sqlx::query(sqlx::AssertSqlSafe(column.add.as_str())))
            .await;
        if let Err(error) = added {
            if !present(pool).await {
                return Err(error);
            }
        }
    }
    Ok(())
}
