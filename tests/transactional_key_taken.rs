//! PostgreSQL's transactional mode writes its record once, at the commit: an owner whose key
//! was recorded by another request in the meantime (a claim of the separate mode on the same
//! table, or a commit that fell between its claim's snapshot and its lock) fails that
//! INSERT. Nothing of it may persist, and it answers with the recorded outcome, as a
//! duplicate. Real server, real concurrent transactions; effects are counted in the database.

#![cfg(feature = "postgres")]

#[path = "common/backends.rs"]
mod backends;
#[path = "common/effects_table.rs"]
mod effects_table;
#[path = "common/pg_effects.rs"]
mod pg_effects;

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use bytes::Bytes;
use pg_effects::effects;
use tokio::sync::Barrier;
use tower_idempotency::{
    engine::{Engine, Execution},
    transactional::Transactional,
    Fingerprint, StoreKey, Token,
};

#[tokio::test]
async fn an_owner_whose_key_was_recorded_meanwhile_rolls_back_and_replays_the_record() {
    let Some((store, table)) = pg_effects::store_and_table(8, "tx_taken").await else {
        return;
    };
    let mode = Transactional::new(store.clone());
    let separate = Engine::new(store.clone());
    let key = StoreKey::new("tx-taken", Token::random().to_hex());
    let fingerprint = Fingerprint::of([b"m".as_slice()]);
    let (op_key, op_table) = (key.clone(), table.clone());
    let execution = mode
        .run_once(key.clone(), fingerprint, move |conn| {
            Box::pin(async move {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO {op_table} (k) VALUES ($1)"
                )))
                .bind(op_key.key())
                .execute(&mut *conn)
                .await?;
                // The separate mode records the same key to the end while this owner runs:
                // its claim holds no advisory lock, so only the final INSERT can see it.
                let recorded = separate
                    .run_once(op_key.clone(), fingerprint, || async {
                        Ok::<_, std::convert::Infallible>(Bytes::from_static(b"separate"))
                    })
                    .await
                    .expect("the separate mode runs the key");
                assert!(matches!(recorded, Execution::Ran(_)), "{recorded:?}");
                Ok::<_, sqlx::Error>(Bytes::from_static(b"transactional"))
            })
        })
        .await
        .expect("run_once");
    assert_eq!(
        execution,
        Execution::Replayed(Bytes::from_static(b"separate"))
    );
    assert_eq!(
        effects(&store, &table, &key).await,
        0,
        "the owner's write rolled back"
    );
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(store.pool())
        .await;
}

/// Many transactional owners and separate-mode runs of the same keys, released together: per
/// key exactly one of them commits its effect, and everyone answers with that one's output.
#[tokio::test]
async fn a_storm_of_both_modes_on_one_key_commits_exactly_one_effect() {
    let Some((store, table)) = pg_effects::store_and_table(8, "tx_taken").await else {
        return;
    };
    const KEYS: usize = 20;
    const COPIES: usize = 8;
    let mode = Transactional::new(store.clone());
    let separate = Engine::new(store.clone());
    let scope = format!("tx-taken-storm-{}", Token::random().to_hex());
    let keys: Vec<StoreKey> = (0..KEYS)
        .map(|i| StoreKey::new(scope.clone(), format!("k{i}")))
        .collect();
    let fingerprint = Fingerprint::of([b"m".as_slice()]);
    let separate_runs: Arc<Vec<AtomicUsize>> =
        Arc::new((0..KEYS).map(|_| AtomicUsize::new(0)).collect());
    let barrier = Arc::new(Barrier::new(KEYS * COPIES));
    let mut tasks = Vec::new();
    for (index, key) in keys.iter().enumerate() {
        for copy in 0..COPIES {
            let (mode, separate, key, table) =
                (mode.clone(), separate.clone(), key.clone(), table.clone());
            let (barrier, separate_runs) = (barrier.clone(), separate_runs.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                if copy % 2 == 0 {
                    let op_key = key.clone();
                    mode.run_once(key, fingerprint, move |conn| {
                        Box::pin(async move {
                            sqlx::query(sqlx::AssertSqlSafe(format!(
                                "INSERT INTO {table} (k) VALUES ($1)"
                            )))
                            .bind(op_key.key())
                            .execute(&mut *conn)
                            .await?;
                            tokio::time::sleep(Duration::from_millis(5)).await;
                            Ok::<_, sqlx::Error>(Bytes::from_static(b"transactional"))
                        })
                    })
                    .await
                    .expect("transactional run")
                    .into_output()
                } else {
                    separate
                        .run_once(key, fingerprint, || async move {
                            separate_runs[index].fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(5)).await;
                            Ok::<_, std::convert::Infallible>(Bytes::from_static(b"separate"))
                        })
                        .await
                        .expect("separate run")
                        .into_output()
                }
            }));
        }
    }
    let mut outputs = Vec::new();
    for task in tasks {
        outputs.push(task.await.expect("no panic"));
    }
    for (index, key) in keys.iter().enumerate() {
        let committed = effects(&store, &table, key).await as usize;
        let ran_separately = separate_runs[index].load(Ordering::SeqCst);
        assert_eq!(committed + ran_separately, 1, "one execution of {key:?}");
        let winner: &[u8] = if committed == 1 {
            b"transactional"
        } else {
            b"separate"
        };
        for output in &outputs[index * COPIES..(index + 1) * COPIES] {
            assert_eq!(
                output.as_ref(),
                winner,
                "every copy of {key:?} answers the winner's output"
            );
        }
    }
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(store.pool())
        .await;
}

/// The record is written with its key and payload as SQL literals (one round trip with the
/// COMMIT): quotes, backslashes and non-ASCII in the key, and every byte value in the
/// payload, come back verbatim, and the key's separate-mode lookup finds the same record.
#[tokio::test]
async fn keys_and_payloads_with_quotes_backslashes_and_any_bytes_are_recorded_verbatim() {
    let Some((store, table)) = pg_effects::store_and_table(8, "tx_taken").await else {
        return;
    };
    let mode = Transactional::new(store.clone());
    let key = StoreKey::new(
        "tx-taken-'\\scope",
        format!("it's a \\'key\\' ü {}", Token::random().to_hex()),
    );
    let fingerprint = Fingerprint::of([b"m".as_slice()]);
    let payload = Bytes::from((0..=255u8).collect::<Vec<u8>>());
    for delivery in 0..2 {
        let output = payload.clone();
        let execution = mode
            .run_once(key.clone(), fingerprint, move |_| {
                Box::pin(async move { Ok::<_, sqlx::Error>(output) })
            })
            .await
            .expect("run_once");
        match (delivery, execution) {
            (0, Execution::Ran(out)) | (1, Execution::Replayed(out)) => assert_eq!(out, payload),
            (delivery, other) => panic!("delivery {delivery}: {other:?}"),
        }
    }
    let separate = Engine::new(store.clone());
    let replayed = separate
        .run_once(key, fingerprint, || async {
            Ok::<_, std::convert::Infallible>(Bytes::from_static(b"ran again"))
        })
        .await
        .expect("separate lookup");
    assert_eq!(replayed, Execution::Replayed(payload));
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(store.pool())
        .await;
}
