//! PostgreSQL's transactional owner opens its own transaction and claims the key in one round
//! trip, with the key written into the query text (as hexadecimal). A claim that finds the key
//! recorded rolls that transaction back: the connection must come back clean, any key must
//! claim and replay, and a key the server cannot hold (a NUL) is refused before anything
//! runs. Real server; effects counted in it.

#![cfg(feature = "postgres")]

#[path = "common/backends.rs"]
mod backends;
#[path = "common/effects_table.rs"]
mod effects_table;
#[path = "common/pg_effects.rs"]
mod pg_effects;

use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use tower_idempotency::{
    engine::Execution, store::PostgresStore, transactional::Transactional, Fingerprint, StoreKey,
    Token,
};

/// A store on a pool of ONE connection, so that every request reuses the connection the
/// previous one left behind, and a table of effects.
async fn one_connection() -> Option<(Transactional<PostgresStore>, String)> {
    let (store, table) = pg_effects::store_and_table(1, "tx_one_trip").await?;
    Some((Transactional::new(store), table))
}

async fn effects(mode: &Transactional<PostgresStore>, table: &str, key: &StoreKey) -> i64 {
    pg_effects::effects(mode.store(), table, key).await
}

/// Runs an operation that records one effect under `key` and answers `output`.
async fn charge(
    mode: &Transactional<PostgresStore>,
    table: &str,
    key: &StoreKey,
    output: &'static str,
) -> Execution {
    let (table, effect_key) = (table.to_owned(), key.key().to_owned());
    mode.run_once(
        key.clone(),
        Fingerprint::of([b"charge".as_slice()]),
        move |conn| {
            Box::pin(async move {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO {table} (k) VALUES ($1)"
                )))
                .bind(effect_key)
                .execute(&mut *conn)
                .await?;
                Ok::<_, sqlx::Error>(Bytes::from_static(output.as_bytes()))
            })
        },
    )
    .await
    .expect("run_once")
}

async fn drop_table(mode: &Transactional<PostgresStore>, table: &str) {
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(mode.store().pool())
        .await;
}

#[tokio::test]
async fn a_replay_leaves_the_one_connection_clean_for_the_next_new_key() {
    let Some((mode, table)) = one_connection().await else {
        return;
    };
    let first = StoreKey::new("tx-one-trip", Token::random().to_hex());
    let second = StoreKey::new("tx-one-trip", Token::random().to_hex());

    assert_eq!(
        charge(&mode, &table, &first, "one").await,
        Execution::Ran(Bytes::from_static(b"one"))
    );
    // The one-trip claim of a recorded key finds its record and rolls its transaction back;
    // the replay must come back, and the only connection must not stay inside a transaction.
    assert_eq!(
        charge(&mode, &table, &first, "again").await,
        Execution::Replayed(Bytes::from_static(b"one"))
    );
    assert_eq!(
        charge(&mode, &table, &second, "two").await,
        Execution::Ran(Bytes::from_static(b"two"))
    );
    assert_eq!(
        charge(&mode, &table, &second, "again").await,
        Execution::Replayed(Bytes::from_static(b"two"))
    );
    assert_eq!(effects(&mode, &table, &first).await, 1);
    assert_eq!(effects(&mode, &table, &second).await, 1);
    // VACUUM refuses to run inside a transaction block.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("VACUUM {table}")))
        .execute(mode.store().pool())
        .await
        .expect("the connection was handed back inside a transaction");
    drop_table(&mode, &table).await;
}

#[tokio::test]
async fn keys_that_need_quoting_claim_and_replay_like_any_other() {
    let Some((mode, table)) = one_connection().await else {
        return;
    };
    let unique = Token::random().to_hex();
    let keys = [
        format!("{unique} it's"),
        format!("{unique} back\\slash\\' E'\\x00"),
        format!("{unique}'; DROP TABLE {table}; --"),
        format!("{unique} Grüße ✓ $1 $$"),
    ];
    for (index, raw) in keys.iter().enumerate() {
        let key = StoreKey::new(format!("tx-one-trip-quoting {raw}"), raw.clone());
        let execution = charge(&mode, &table, &key, "ran").await;
        assert_eq!(
            execution,
            Execution::Ran(Bytes::from_static(b"ran")),
            "key {index}"
        );
        let again = charge(&mode, &table, &key, "twice").await;
        assert_eq!(
            again,
            Execution::Replayed(Bytes::from_static(b"ran")),
            "key {index}"
        );
        assert_eq!(effects(&mode, &table, &key).await, 1, "key {index}");
    }
    drop_table(&mode, &table).await;
}

#[tokio::test]
async fn a_key_with_a_nul_is_refused_before_anything_runs() {
    let Some((mode, table)) = one_connection().await else {
        return;
    };
    let key = StoreKey::new("tx-one-trip", format!("{}\0tail", Token::random().to_hex()));
    let ran = AtomicUsize::new(0);
    let result = mode
        .run_once(key.clone(), Fingerprint::of([b"nul".as_slice()]), |_conn| {
            ran.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok::<_, sqlx::Error>(Bytes::from_static(b"never")) })
        })
        .await;
    assert!(result.is_err(), "a NUL key was accepted: {result:?}");
    assert_eq!(ran.load(Ordering::SeqCst), 0, "the operation ran");
    // The refusal did not poison the only connection either.
    let other = StoreKey::new("tx-one-trip", Token::random().to_hex());
    assert_eq!(
        charge(&mode, &table, &other, "fine").await,
        Execution::Ran(Bytes::from_static(b"fine"))
    );
    drop_table(&mode, &table).await;
}
