//! A PostgreSQL store and a table of effects of its own, for tests that count in the database
//! what an operation wrote (one row per effect, `k` = the key).

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use tower_idempotency::{store::PostgresStore, StoreKey, Token};

use super::backends;

/// A migrated store on a pool of `connections`, and a new effects table named
/// `{prefix}_<random>`; `None` (skip) without `TEST_POSTGRES_URL`.
pub async fn store_and_table(connections: u32, prefix: &str) -> Option<(PostgresStore, String)> {
    let url = backends::url_or_skip("TEST_POSTGRES_URL")?;
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&url)
        .await
        .expect("TEST_POSTGRES_URL is set but unreachable");
    let store = PostgresStore::new(pool);
    store.migrate().await.expect("migrate");
    let table = format!("{prefix}_{}", &Token::random().to_hex()[..12]);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {table} (k TEXT NOT NULL)"
    )))
    .execute(store.pool())
    .await
    .expect("create the effects table");
    Some((store, table))
}

/// How many effects `table` holds for `key`.
pub async fn effects(store: &PostgresStore, table: &str, key: &StoreKey) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM {table} WHERE k = $1"
    )))
    .bind(key.key())
    .fetch_one(store.pool())
    .await
    .expect("count effects")
}
