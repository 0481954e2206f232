//! Recovery points (`tower_idempotency::steps`) against real databases: finished steps are not
//! run again, a fenced-out owner's entry is refused, and a takeover waits for an owner that is
//! inside a step. Each effect is a row counted in the database.
//!
//! ```text
//! TEST_POSTGRES_URL=postgres://root@127.0.0.1/test cargo test --all-features --test steps
//! ```
#![cfg(all(feature = "postgres", feature = "sqlite"))]

#[path = "common/backends.rs"]
mod backends;
#[path = "common/sqlite_file.rs"]
mod sqlite_file;

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use tower_idempotency::{
    engine::{Begin, Execution, RunError},
    steps::{KeyOwner, PostgresJournal, SqliteJournal, StepError, Steps},
    store::{PostgresStore, SqliteStore, Store},
    Engine, Fingerprint, StoreKey,
};

fn unique() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// A store, its journal and an effects table, private to one test.
struct Fixture<J> {
    store: Arc<dyn Store>,
    journal: J,
    /// Runs one SQL statement on the test's database.
    exec: Arc<dyn Fn(String) -> futures_util::future::BoxFuture<'static, ()> + Send + Sync>,
    /// Counts the rows of the effects table.
    count: Arc<dyn Fn() -> futures_util::future::BoxFuture<'static, i64> + Send + Sync>,
    effects: String,
    records: String,
    /// SQL for "the lease of every claim in the records table has run out".
    expire: String,
}

async fn postgres() -> Option<Fixture<PostgresJournal>> {
    let url = backends::url_or_skip("TEST_POSTGRES_URL")?;
    let pool = backends::reachable(
        "TEST_POSTGRES_URL",
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(6)
            .connect(&url)
            .await,
    )?;
    let u = unique();
    let (records, effects) = (format!("steps_rec_{u}"), format!("steps_fx_{u}"));
    let store = PostgresStore::builder(pool.clone())
        .table(&records)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let journal = PostgresJournal::with_table(&store, &format!("steps_j_{u}")).unwrap();
    journal.migrate().await.unwrap();
    let (p1, p2) = (pool.clone(), pool.clone());
    let fx = effects.clone();
    let fixture = Fixture {
        store: Arc::new(store),
        journal,
        exec: Arc::new(move |sql| {
            let pool = p1.clone();
            Box::pin(async move {
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .execute(&pool)
                    .await
                    .unwrap();
            })
        }),
        count: Arc::new(move || {
            let (pool, fx) = (p2.clone(), fx.clone());
            Box::pin(async move {
                sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {fx}")))
                    .fetch_one(&pool)
                    .await
                    .unwrap()
            })
        }),
        expire: format!(
            "UPDATE {records} SET expires_at = now() - interval '1 second' WHERE payload IS NULL"
        ),
        effects,
        records,
    };
    (fixture.exec)(format!(
        "CREATE TABLE {} (note TEXT NOT NULL)",
        fixture.effects
    ))
    .await;
    Some(fixture)
}

async fn sqlite() -> Option<Fixture<SqliteJournal>> {
    let store = SqliteStore::open(sqlite_file::fresh_path("steps"))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let journal = SqliteJournal::for_store(&store);
    journal.migrate().await.unwrap();
    let pool = store.pool().clone();
    let (p1, p2) = (pool.clone(), pool.clone());
    let records = store.table().as_str().to_owned();
    let effects = "effects".to_owned();
    let fixture = Fixture {
        store: Arc::new(store),
        journal,
        exec: Arc::new(move |sql| {
            let pool = p1.clone();
            Box::pin(async move {
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .execute(&pool)
                    .await
                    .unwrap();
            })
        }),
        count: Arc::new(move || {
            let pool = p2.clone();
            Box::pin(async move {
                sqlx::query_scalar("SELECT count(*) FROM effects")
                    .fetch_one(&pool)
                    .await
                    .unwrap()
            })
        }),
        expire: format!("UPDATE {records} SET expires_at = 0 WHERE payload IS NULL"),
        effects,
        records,
    };
    (fixture.exec)("CREATE TABLE effects (note TEXT NOT NULL)".to_owned()).await;
    Some(fixture)
}

/// The tests, once per database: `$open` makes the fixture, `$database` its sqlx database.
macro_rules! journal_tests {
    ($db:ident, $open:ident, $database:ty) => {
        mod $db {
            use super::*;

            /// The local phase of the tests: one effect row, and a fresh id as its output (a
            /// value that differs per run, so a replayed output is told from a re-run).
            async fn record(
                steps: &Steps<tower_idempotency::steps::SqlJournal<$database>>,
                effects: &str,
            ) -> Result<String, String> {
                let insert = format!("INSERT INTO {effects} (note) VALUES ('x')");
                steps
                    .local("record", move |conn| {
                        Box::pin(async move {
                            sqlx::query(sqlx::AssertSqlSafe(insert))
                                .execute(&mut *conn)
                                .await?;
                            Ok::<_, sqlx::Error>(format!("pay_{}", unique()))
                        })
                    })
                    .await
                    .map_err(|e| e.to_string())
            }

            /// An operation that fails after its two steps finished resumes after them: the
            /// retry runs neither again, gets their first outputs, and the same derived key
            /// was the only one sent downstream.
            #[tokio::test]
            async fn finished_steps_are_not_run_again() {
                let Some(fx) = $open().await else { return };
                let engine = Engine::new(fx.store.clone());
                let key = StoreKey::new("alice", unique());
                let fingerprint = Fingerprint::of([b"pay 12".as_slice()]);
                let calls = Arc::new(AtomicUsize::new(0));
                let keys = Arc::new(Mutex::new(Vec::new()));
                let mut outputs = Vec::new();
                for attempt in 0..3 {
                    let (calls, keys, effects) = (calls.clone(), keys.clone(), fx.effects.clone());
                    let result = engine
                        .run_steps(
                            fx.journal.clone(),
                            key.clone(),
                            fingerprint,
                            |steps| async move {
                                let id = record(&steps, &effects).await?;
                                let charge: String = steps
                                    .foreign("charge", |derived| async move {
                                        calls.fetch_add(1, Ordering::SeqCst);
                                        keys.lock().unwrap().push(derived);
                                        Ok::<_, std::io::Error>(format!("ch_{}", unique()))
                                    })
                                    .await
                                    .map_err(|e| e.to_string())?;
                                if attempt == 0 {
                                    return Err("the process failed after the charge".to_owned());
                                }
                                Ok(Bytes::from(format!("{id} {charge}")))
                            },
                        )
                        .await;
                    outputs.push(result);
                }
                assert!(
                    matches!(outputs[0], Err(RunError::Operation(_))),
                    "{:?}",
                    outputs[0]
                );
                let Ok(Execution::Ran(ran)) = &outputs[1] else {
                    panic!("{:?}", outputs[1])
                };
                assert_eq!(
                    outputs[2].as_ref().unwrap(),
                    &Execution::Replayed(ran.clone())
                );
                assert_eq!((fx.count)().await, 1, "one local effect");
                assert_eq!(calls.load(Ordering::SeqCst), 1, "one call downstream");
                assert_eq!(
                    keys.lock().unwrap()[0],
                    KeyOwner::derive(&key, "charge"),
                    "the derived key went downstream"
                );
            }

            /// An owner whose key was taken over can journal nothing: its local phase is
            /// rolled back and its foreign call's entry refused; the new owner resumes from
            /// what the old one journaled before, calling downstream with the same key.
            ///
            /// mutant: the fence without `token = ?` (any live claim passes) -> fails: the
            /// late phase answers `Ok(())` instead of `Fenced`.
            #[tokio::test]
            async fn a_fenced_owner_cannot_journal() {
                let Some(fx) = $open().await else { return };
                let engine = Engine::new(fx.store.clone());
                let key = StoreKey::new("alice", unique());
                let fingerprint = Fingerprint::of([b"pay 12".as_slice()]);
                let Begin::Run(old) = engine.begin(key.clone(), fingerprint).await.unwrap() else {
                    panic!("the first claim runs")
                };
                let old_steps = Steps::resume(fx.journal.clone(), KeyOwner::of(&old))
                    .await
                    .unwrap();
                let first = record(&old_steps, &fx.effects).await.unwrap();

                // The old owner's lease runs out (a stall) and another request takes the key.
                (fx.exec)(fx.expire.clone()).await;
                let Begin::Run(new) = engine.begin(key.clone(), fingerprint).await.unwrap() else {
                    panic!("the takeover runs")
                };

                let again = format!("INSERT INTO {} (note) VALUES ('late')", fx.effects);
                let late = old_steps
                    .local("late", move |conn| {
                        Box::pin(async move {
                            sqlx::query(sqlx::AssertSqlSafe(again))
                                .execute(&mut *conn)
                                .await?;
                            Ok::<_, sqlx::Error>(())
                        })
                    })
                    .await;
                assert!(matches!(late, Err(StepError::Fenced { .. })), "{late:?}");
                assert_eq!(
                    (fx.count)().await,
                    1,
                    "the fenced owner's phase rolled back"
                );
                let sent = Arc::new(Mutex::new(Vec::new()));
                let sent1 = sent.clone();
                let charge = old_steps
                    .foreign("charge", |derived| async move {
                        sent1.lock().unwrap().push(derived);
                        Ok::<_, std::io::Error>("ch_old".to_owned())
                    })
                    .await;
                assert!(
                    matches!(charge, Err(StepError::Fenced { .. })),
                    "{charge:?}"
                );

                let new_steps = Steps::resume(fx.journal.clone(), KeyOwner::of(&new))
                    .await
                    .unwrap();
                assert_eq!(
                    new_steps.finished(),
                    1,
                    "only the step journaled before the takeover"
                );
                assert_eq!(record(&new_steps, &fx.effects).await.unwrap(), first);
                let sent2 = sent.clone();
                let charge: String = new_steps
                    .foreign("charge", |derived| async move {
                        sent2.lock().unwrap().push(derived);
                        Ok::<_, std::io::Error>("ch_new".to_owned())
                    })
                    .await
                    .unwrap();
                assert_eq!(charge, "ch_new");
                let sent = sent.lock().unwrap().clone();
                assert_eq!(sent.len(), 2);
                assert_eq!(sent[0], sent[1], "both owners sent the same derived key");
                assert_eq!((fx.count)().await, 1, "one local effect");
                new.complete(Bytes::from_static(b"done")).await.unwrap();
                assert!(
                    old.release().await.is_err(),
                    "the old owner's token is stale"
                );
            }

            /// A takeover cannot slip in while the owner is inside a local phase: the owner's
            /// lease is ended (from another connection) while the phase runs and a duplicate
            /// arrives at that moment; the lease ends, and the duplicate gets the key, only
            /// once the phase committed, so it finds the step journaled and does not run it.
            ///
            /// mutant: PostgreSQL fence without `FOR SHARE` -> fails with "the takeover found
            /// the step journaled" (0 finished); SQLite `BEGIN` instead of `BEGIN IMMEDIATE`
            /// -> the phase's late write fails with SQLITE_BUSY (a snapshot older than the
            /// takeover) and the duplicate found 0 finished steps.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_takeover_waits_for_a_running_phase() {
                let Some(fx) = $open().await else { return };
                let owner = Engine::new(fx.store.clone());
                let duplicate = Engine::new(fx.store.clone());
                let key = StoreKey::new("alice", unique());
                let fingerprint = Fingerprint::of([b"pay 12".as_slice()]);
                let Begin::Run(claim) = owner.begin(key.clone(), fingerprint).await.unwrap() else {
                    panic!("the first claim runs")
                };
                let steps = Steps::resume(fx.journal.clone(), KeyOwner::of(&claim))
                    .await
                    .unwrap();
                let insert = format!("INSERT INTO {} (note) VALUES ('x')", fx.effects);
                let phase = tokio::spawn(async move {
                    let done = steps
                        .local("record", move |conn| {
                            Box::pin(async move {
                                // Fenced, not yet written: the window a takeover must not use.
                                tokio::time::sleep(Duration::from_millis(800)).await;
                                sqlx::query(sqlx::AssertSqlSafe(insert))
                                    .execute(&mut *conn)
                                    .await?;
                                tokio::time::sleep(Duration::from_millis(300)).await;
                                Ok::<_, sqlx::Error>("pay_1".to_owned())
                            })
                        })
                        .await;
                    (done, Instant::now(), claim)
                });
                tokio::time::sleep(Duration::from_millis(200)).await;
                let expire = tokio::spawn((fx.exec)(fx.expire.clone()));
                tokio::time::sleep(Duration::from_millis(200)).await;
                let taken = duplicate.begin(key.clone(), fingerprint).await.unwrap();
                let taken_at = Instant::now();
                let Begin::Run(new) = taken else {
                    panic!("the takeover runs: {taken:?}")
                };
                let new_steps = Steps::resume(fx.journal.clone(), KeyOwner::of(&new))
                    .await
                    .unwrap();
                let finished = new_steps.finished();
                let (done, committed_at, _old) = phase.await.unwrap();
                expire.await.unwrap();
                assert_eq!(finished, 1, "the takeover found the step journaled");
                assert_eq!(done.unwrap(), "pay_1", "the phase committed");
                assert!(
                    taken_at >= committed_at,
                    "the takeover waited for the phase's commit"
                );
                assert_eq!((fx.count)().await, 1);
                let _ = &fx.records;
            }
        }
    };
}

journal_tests!(postgres, postgres, sqlx::Postgres);
journal_tests!(sqlite, sqlite, sqlx::Sqlite);

/// The memory journal (foreign calls only): a retry after a failure does not call again, and
/// an owner whose key was forgotten and claimed anew cannot journal.
#[tokio::test]
async fn memory_journal_resumes_and_fences() {
    use tower_idempotency::{steps::MemoryJournal, store::MemoryStore};
    let store = MemoryStore::new();
    let journal = MemoryJournal::for_store(&store);
    let engine = Engine::new(store.clone());
    let key = StoreKey::new("alice", unique());
    let fingerprint = Fingerprint::of([b"mail".as_slice()]);
    let calls = Arc::new(AtomicUsize::new(0));
    for attempt in 0..2 {
        let calls = calls.clone();
        let result = engine
            .run_steps(
                journal.clone(),
                key.clone(),
                fingerprint,
                |steps| async move {
                    let sent: String = steps
                        .foreign("send", |derived| async move {
                            calls.fetch_add(1, Ordering::SeqCst);
                            Ok::<_, std::io::Error>(derived)
                        })
                        .await
                        .map_err(|e| e.to_string())?;
                    if attempt == 0 {
                        return Err("failed after sending".to_owned());
                    }
                    Ok(Bytes::from(sent))
                },
            )
            .await;
        assert_eq!(result.is_ok(), attempt == 1, "{result:?}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    let other = StoreKey::new("alice", unique());
    let Begin::Run(old) = engine.begin(other.clone(), fingerprint).await.unwrap() else {
        panic!("the first claim runs")
    };
    let steps = Steps::resume(journal.clone(), KeyOwner::of(&old))
        .await
        .unwrap();
    store.forget(&other).await.unwrap();
    let Begin::Run(_new) = engine.begin(other, fingerprint).await.unwrap() else {
        panic!("the key is free again")
    };
    let late = steps
        .foreign("send", |_| async { Ok::<_, std::io::Error>(1) })
        .await;
    assert!(matches!(late, Err(StepError::Fenced { .. })), "{late:?}");
}
