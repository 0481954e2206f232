//! Recovery points (`tower_idempotency::steps`) against real databases: finished steps are not
//! run again, a fenced-out owner's entry is refused, and a takeover waits for an owner that is
//! inside a step. Each effect is a row counted in the database.
//!
//! ```text
//! TEST_POSTGRES_URL=postgres://root@127.0.0.1/test TEST_MYSQL_URL=mysql://root@127.0.0.1/test \
//!     cargo test --all-features --test steps
//! ```
#![cfg(all(
    feature = "postgres",
    feature = "mysql",
    feature = "sqlite",
    feature = "conformance"
))]

#[path = "common/backends.rs"]
mod backends;
#[path = "common/sqlite_file.rs"]
mod sqlite_file;

use std::{
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use tower_idempotency::{
    engine::{Begin, Execution, RunError},
    steps::{
        Completer, Journal, KeyOwner, MySqlJournal, PostgresJournal, SqliteJournal, StepError,
        Steps, UnknownOperation,
    },
    store::{MySqlStore, PostgresStore, SqliteStore, Store},
    Engine, Fingerprint, Record, StoreKey,
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

/// The fixture of a test on `pool`: its statements and counts run there.
async fn on_pool<DB, J>(
    pool: sqlx::Pool<DB>,
    store: Arc<dyn Store>,
    journal: J,
    tables: (String, String),
    expire: String,
) -> Fixture<J>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    i64: for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    let (records, effects) = tables;
    let (p1, p2) = (pool.clone(), pool);
    let fx = effects.clone();
    let fixture = Fixture {
        store,
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
        expire,
        effects,
        records,
    };
    (fixture.exec)(format!(
        "CREATE TABLE {} (note TEXT NOT NULL)",
        fixture.effects
    ))
    .await;
    fixture
}

/// A records table and an effects table no other test uses.
fn tables() -> (String, String) {
    let u = unique();
    (format!("steps_rec_{u}"), format!("steps_fx_{u}"))
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
    let (records, effects) = tables();
    let store = PostgresStore::builder(pool.clone())
        .table(&records)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let journal = PostgresJournal::with_table(&store, &format!("{records}_j")).unwrap();
    journal.migrate().await.unwrap();
    let expire = format!(
        "UPDATE {records} SET expires_at = now() - interval '1 second' WHERE payload IS NULL"
    );
    Some(on_pool(pool, Arc::new(store), journal, (records, effects), expire).await)
}

async fn mysql() -> Option<Fixture<MySqlJournal>> {
    let url = backends::url_or_skip("TEST_MYSQL_URL")?;
    let pool = backends::reachable(
        "TEST_MYSQL_URL",
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(6)
            .connect(&url)
            .await,
    )?;
    let (records, effects) = tables();
    let store = MySqlStore::builder(pool.clone())
        .table(&records)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let journal = MySqlJournal::with_table(&store, &format!("{records}_j")).unwrap();
    journal.migrate().await.unwrap();
    let expire = format!(
        "UPDATE {records} SET expires_at = UTC_TIMESTAMP(3) - INTERVAL 1 SECOND \
         WHERE payload IS NULL"
    );
    Some(on_pool(pool, Arc::new(store), journal, (records, effects), expire).await)
}

async fn sqlite() -> Option<Fixture<SqliteJournal>> {
    let store = SqliteStore::open(sqlite_file::fresh_path("steps"))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let journal = SqliteJournal::for_store(&store);
    journal.migrate().await.unwrap();
    let pool = store.pool().clone();
    let records = store.table().as_str().to_owned();
    let expire = format!("UPDATE {records} SET expires_at = 0 WHERE payload IS NULL");
    let tables = (records, "effects".to_owned());
    Some(on_pool(pool, Arc::new(store), journal, tables, expire).await)
}

/// How the owner of the completer tests dies.
#[derive(Clone, Copy, Debug)]
enum Death {
    /// Its future is dropped on the runtime: the claim's drop releases the key at once.
    Dropped,
    /// Its future is dropped on a thread without a runtime, so nothing of it runs again, as
    /// in a process killed with SIGKILL: the claim stays until its lease (3 s) runs out.
    Killed,
}

/// The completer test on any journal: `local` is the operation's local part (a payment row
/// where the journal has a database); its foreign step charges, and the first attempt then
/// hangs until its owner dies as `death` says.
async fn completer_finishes_an_orphan<J, L, Fut>(
    store: Arc<dyn Store>,
    journal: J,
    local: L,
    death: Death,
) where
    J: Journal + Clone,
    L: Fn(Steps<J>, Bytes) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<String, String>> + Send + 'static,
{
    let charged = Arc::new(tokio::sync::Notify::new());
    let (first, tag) = (Arc::new(AtomicBool::new(true)), unique());
    let signal = charged.clone();
    let (charge_tag, charges) = (tag.clone(), Arc::new(AtomicUsize::new(0)));
    let counted = charges.clone();
    // A short lease for the killed owner (a store timeout within the lease's bound).
    let engine = Engine::builder(store.clone())
        .lease(Duration::from_secs(3))
        .store_timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let completer =
        Completer::new(engine, journal).operation("pay", move |steps: Steps<J>, input: Bytes| {
            let local = local(steps.clone(), input);
            let (first, signal, tag) = (first.clone(), signal.clone(), charge_tag.clone());
            let charges = counted.clone();
            async move {
                let paid = local.await?;
                let charge: String = steps
                    .foreign("charge", |_| async move {
                        charges.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, std::io::Error>(format!("ch_{tag}_{}", unique()))
                    })
                    .await
                    .map_err(|e| e.to_string())?;
                if first.swap(false, Ordering::SeqCst) {
                    signal.notify_one();
                    std::future::pending::<()>().await;
                }
                Ok::<_, String>(Bytes::from(format!("{paid} {charge}")))
            }
        });
    let key = StoreKey::new("alice", unique());
    let fingerprint = Fingerprint::of([b"pay 12".as_slice()]);
    let mut owner = Box::pin({
        let (completer, key) = (completer.clone(), key.clone());
        async move {
            completer
                .run(key, fingerprint, "pay", Bytes::from_static(b"12"))
                .await
        }
    });
    tokio::select! {
        done = &mut owner => panic!("the first attempt hangs after its charge: {done:?}"),
        () = charged.notified() => {}
    }
    match death {
        Death::Dropped => drop(owner),
        Death::Killed => {
            std::thread::spawn(move || drop(owner)).join().unwrap();
            assert!(
                matches!(
                    store.lookup(&key).await.unwrap(),
                    Some(Record::InProgress { .. })
                ),
                "the killed owner's claim stays until its lease runs out"
            );
        }
    }

    // The release runs on a task of its own, the lease runs out in 3 s: poll until the
    // completer finds the orphan.
    // The dropped owner's orphan is finished by passes called here, the killed one's by the
    // completer's background task.
    let deadline = Instant::now() + Duration::from_secs(20);
    let task =
        matches!(death, Death::Killed).then(|| completer.clone().spawn(Duration::from_millis(50)));
    loop {
        let found = match task {
            None => completer.complete_orphans(10).await.unwrap() > 0,
            Some(_) => matches!(
                store.lookup(&key).await.unwrap(),
                Some(Record::Completed { .. })
            ),
        };
        if found {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the completer found no orphan ({death:?})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if let Some(task) = task {
        task.abort();
    }
    let retry = completer
        .run(key.clone(), fingerprint, "pay", Bytes::from_static(b"12"))
        .await
        .unwrap();
    let Execution::Replayed(answer) = retry else {
        panic!("the retry replays the completer's answer: {retry:?}")
    };
    assert!(
        String::from_utf8_lossy(&answer).contains(&format!("ch_{tag}_")),
        "{answer:?}"
    );
    assert_eq!(
        engine_replay(store, &key, fingerprint).await,
        answer,
        "every retry gets the same answer"
    );
    assert_eq!(charges.load(Ordering::SeqCst), 1, "one charge");
    assert_eq!(
        completer.complete_orphans(10).await.unwrap(),
        0,
        "nothing left"
    );
}

/// What a plain retry of `key` gets back.
async fn engine_replay(store: Arc<dyn Store>, key: &StoreKey, fingerprint: Fingerprint) -> Bytes {
    match Engine::new(store)
        .begin(key.clone(), fingerprint)
        .await
        .unwrap()
    {
        Begin::Replay(answer) => answer,
        Begin::Run(_) => panic!("the key is free: nothing was recorded"),
    }
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

            /// The journal contract every journal passes (`conformance::journal`).
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn journal_conformance() {
                let Some(fx) = $open().await else { return };
                tower_idempotency::conformance::journal::run_all(
                    fx.store.clone(),
                    fx.journal.clone(),
                )
                .await;
            }

            /// An owner that dies after the charge (its future dropped, its claim released)
            /// leaves the operation to the completer, which takes the key, resumes after the
            /// journaled steps and stores the answer; the client's retry replays it. One
            /// charge, one payment.
            ///
            /// mutant: `Steps::journaled` always `None` (the completer ignores the journal)
            /// -> fails with "one charge" (left: 2). mutant: PostgreSQL's `orphans` without
            /// `r.expires_at > now()` (an expired claim counts as alive) -> fails with "the
            /// completer found no orphan (Killed)".
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_completer_finishes_an_orphan() {
                let Some(fx) = $open().await else { return };
                let effects = fx.effects.clone();
                let pay = move |steps: Steps<tower_idempotency::steps::SqlJournal<$database>>,
                                input: Bytes| {
                    let effects = effects.clone();
                    async move {
                        let id = record(&steps, &effects).await?;
                        Ok::<_, String>(format!("{id} {input:?}"))
                    }
                };
                for death in [Death::Dropped, Death::Killed] {
                    completer_finishes_an_orphan(
                        fx.store.clone(),
                        fx.journal.clone(),
                        pay.clone(),
                        death,
                    )
                    .await;
                }
                assert_eq!((fx.count)().await, 2, "one local effect per operation");
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
            /// mutant: PostgreSQL fence without `FOR SHARE`, or MySQL's without `LOCK IN SHARE
            /// MODE` -> fails with "the takeover found the step journaled" (0 finished); SQLite `BEGIN` instead of `BEGIN IMMEDIATE`
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
journal_tests!(mysql, mysql, sqlx::MySql);
journal_tests!(sqlite, sqlite, sqlx::Sqlite);

/// The completer on the memory journal (foreign calls only) finishes an orphan, leaves alone
/// an operation that failed by itself (its client's retry decides), and refuses an operation
/// no one registered without leaving an orphan behind.
///
/// mutant: the completer does not mark a failed operation (no `@failed` entry) -> fails with
/// "the completer left the failed operation alone" (left: 2). mutant: `@operation` journaled
/// before the name is looked up -> fails with "assertion failed: journal.entries(&unknown,
/// &fingerprint).await.unwrap().is_empty()".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_completer() {
    use tower_idempotency::{steps::MemoryJournal, store::MemoryStore};
    let store = MemoryStore::new();
    let journal = MemoryJournal::for_store(&store);
    let nothing_local = |_, _| async { Ok::<_, String>(String::new()) };
    for death in [Death::Dropped, Death::Killed] {
        completer_finishes_an_orphan(
            Arc::new(store.clone()),
            journal.clone(),
            nothing_local,
            death,
        )
        .await;
    }

    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let completer = Completer::new(Engine::new(store), journal.clone()).operation(
        "decline",
        move |steps, _| {
            counted.fetch_add(1, Ordering::SeqCst);
            async move {
                steps
                    .foreign("charge", |_| async {
                        Err::<String, _>(std::io::Error::other("declined"))
                    })
                    .await
                    .map(Bytes::from)
                    .map_err(|e| e.to_string())
            }
        },
    );
    let key = StoreKey::new("alice", unique());
    let declined = completer
        .run(
            key,
            Fingerprint::of([b"x".as_slice()]),
            "decline",
            Bytes::new(),
        )
        .await;
    assert!(
        matches!(declined, Err(RunError::Operation(_))),
        "{declined:?}"
    );
    completer.complete_orphans(10).await.unwrap();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the completer left the failed operation alone"
    );

    // An operation no one registered is refused before anything is journaled.
    let (unknown, fingerprint) = (
        StoreKey::new("alice", unique()),
        Fingerprint::of([b"y".as_slice()]),
    );
    let refused = completer
        .run(unknown.clone(), fingerprint, "refund", Bytes::new())
        .await;
    assert!(
        matches!(&refused, Err(RunError::Operation(e)) if e.is::<UnknownOperation>()),
        "{refused:?}"
    );
    assert!(journal
        .entries(&unknown, &fingerprint)
        .await
        .unwrap()
        .is_empty());
}

/// The memory journal passes the journal contract.
#[tokio::test]
async fn memory_journal_conformance() {
    use tower_idempotency::{steps::MemoryJournal, store::MemoryStore};
    let store = MemoryStore::new();
    let journal = MemoryJournal::for_store(&store);
    tower_idempotency::conformance::journal::run_all(Arc::new(store), journal).await;
}

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
