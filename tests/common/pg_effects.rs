//! A PostgreSQL store and a table of effects of its own, for tests that count in the database
//! what an operation wrote (one row per effect, `k` = the key).

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use tower_idempotency::{store::PostgresStore, StoreKey};

use super::{backends, effects_table};

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
    let table = effects_table::create(store.pool(), prefix).await;
    Some((store, table))
}

/// How many effects `table` holds for `key`.
pub async fn effects(store: &PostgresStore, table: &str, key: &StoreKey) -> i64 {
    effects_table::count_rows(store.pool(), table, "k", key).await
}
