//! What the crate's own tables beside the stores (the outbox and the inbox) do the same way
//! on each database: count changed rows, bind a purge's age and row limit, and run a schema
//! of several statements.

use std::time::Duration;

use sqlx::Database;

/// A statement with its parameters, bound as the dialect writes them.
pub(crate) type Query<DB> = sqlx::query::Query<'static, DB, <DB as Database>::Arguments>;

/// The per-database half of the outbox's and the inbox's dialects. Implemented by this crate
/// only (`pub` in a private module, as the sealed dialects that extend it need).
pub trait OwnTable: Database {
    /// How many rows a statement changed (sqlx has no trait for it).
    fn rows_affected(result: &Self::QueryResult) -> u64;

    /// Binds the age and the row limit to a `purge` statement, in the unit its `now - ?`
    /// counts in: PostgreSQL milliseconds (a float, times an interval), MySQL microseconds
    /// (`TIMESTAMPADD`), SQLite milliseconds (this crate's clock column).
    fn bind_age_limit(query: Query<Self>, age: Duration, limit: u32) -> Query<Self>;
}

/// The part of [`OwnTable`] that is the same text on every database.
macro_rules! rows_affected {
    () => {
        fn rows_affected(result: &Self::QueryResult) -> u64 {
            result.rows_affected()
        }
    };
}

#[cfg(feature = "postgres")]
impl OwnTable for sqlx::Postgres {
    rows_affected!();

    fn bind_age_limit(query: Query<Self>, age: Duration, limit: u32) -> Query<Self> {
        let millis = i64::try_from(age.as_millis()).unwrap_or(i64::MAX);
        query.bind(millis as f64).bind(i64::from(limit))
    }
}

#[cfg(feature = "mysql")]
impl OwnTable for sqlx::MySql {
    rows_affected!();

    fn bind_age_limit(query: Query<Self>, age: Duration, limit: u32) -> Query<Self> {
        let micros = i64::try_from(age.as_micros()).unwrap_or(i64::MAX);
        query.bind(micros).bind(limit)
    }
}

#[cfg(feature = "sqlite")]
impl OwnTable for sqlx::Sqlite {
    rows_affected!();

    fn bind_age_limit(query: Query<Self>, age: Duration, limit: u32) -> Query<Self> {
        let millis = i64::try_from(age.as_millis()).unwrap_or(i64::MAX);
        query.bind(millis).bind(limit)
    }
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
