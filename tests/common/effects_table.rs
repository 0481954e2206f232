//! A table of effects of a test's own (one row per effect, `k` = the key), on any of the SQL
//! servers: tests count in the database what an operation wrote.
#![allow(dead_code)]

use tower_idempotency::{StoreKey, Token};

/// Creates a new effects table named `{prefix}_<random>` and returns its name.
pub async fn create<DB: sqlx::Database>(pool: &sqlx::Pool<DB>, prefix: &str) -> String
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let table = format!("{prefix}_{}", &Token::random().to_hex()[..12]);
    // TEXT: the one column type PostgreSQL, MariaDB and SQLite all spell the same.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {table} (k TEXT NOT NULL)"
    )))
    .execute(pool)
    .await
    .expect("create the effects table");
    table
}

/// How many rows of `table` have `column` equal to `key`'s key: `k` for the effects of
/// [`create`]; `column` as the SQL names it (MariaDB wants the records' `` `key` `` quoted).
pub async fn count_rows<DB: sqlx::Database>(
    pool: &sqlx::Pool<DB>,
    table: &str,
    column: &str,
    key: &StoreKey,
) -> i64
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'r> i64: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    // PostgreSQL numbers its placeholders; MariaDB and SQLite take `?`.
    let placeholder = if DB::NAME == "PostgreSQL" { "$1" } else { "?" };
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM {table} WHERE {column} = {placeholder}"
    )))
    .bind(key.key().to_owned())
    .fetch_one(pool)
    .await
    .expect("count rows")
}
