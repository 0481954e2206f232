//! The transactional mode with a handler that takes longer than the lease, on SQLite (MySQL /
//! MariaDB share the code path: the claim is a row with a lease). Found by the spin model
//! (model/README.md, finding 2, mutant `tx-rows-lease-fence`).
//!
//! Nobody can take the key over while the owner's transaction is open (its row lock, or
//! SQLite's one writer), so the commit is fenced by the token alone: fenced by the lease as
//! well, as it once was, the charge rolled back and every retry as slow ended the same way,
//! so the key never completed.
#![cfg(feature = "sqlite")]

#[path = "common/sqlite_file.rs"]
mod sqlite_file;

use std::time::Duration;

use bytes::Bytes;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use tower_idempotency::{
    engine::Execution, store::SqliteStore, transactional::Transactional, Engine, Fingerprint,
    StoreKey,
};

const LEASE: Duration = Duration::from_millis(300);

#[tokio::test]
async fn a_handler_slower_than_the_lease_commits_its_charge_once() {
    let path = sqlite_file::fresh_path("slow-handler");
    let options = SqliteStore::durable_options(
        SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true),
    );
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("open a SQLite file");
    sqlx::query("CREATE TABLE charges (k TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let store = SqliteStore::new(pool.clone());
    store.migrate().await.unwrap();
    let engine = Engine::builder(store.clone())
        .lease(LEASE)
        .store_timeout(LEASE / 6)
        .build()
        .expect("valid timings");
    let mode = Transactional::with_engine(store, engine);
    let key = StoreKey::new("model", "slow-handler");

    let result = mode
        .run_once(key, Fingerprint::of([b"charge".as_slice()]), |tx| {
            Box::pin(async move {
                sqlx::query("INSERT INTO charges (k) VALUES ('slow-handler')")
                    .execute(&mut *tx)
                    .await?;
                // Longer than the lease: nobody can claim the key meanwhile (SQLite's write
                // lock is this transaction's), so nothing is lost by waiting.
                tokio::time::sleep(LEASE * 2).await;
                Ok::<_, sqlx::Error>(Bytes::from_static(b"charged"))
            })
        })
        .await;

    let charges: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM charges")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(
        matches!(result, Ok(Execution::Ran(_))),
        "the slow handler's transaction did not commit: {result:?}"
    );
    assert_eq!(charges, 1, "the charge must be committed exactly once");
}
