//! The fault suite: every backend (memory, SQLite, PostgreSQL, MySQL/MariaDB, Redis), real
//! servers, through the engine, with faults injected by a wrapper around the real store
//! (`common::faulty`): the store down before, during and after the operation; a slow store;
//! renewals that fail or hang twice in a row; a handler that blocks its thread; duplicate
//! storms that would exhaust a pool. Every scenario ends by checking that the operation ran
//! exactly once (a run counter), that the key is not left claimed, and that no waiter entry
//! is left behind.
//!
//! Duplicates from "another process" are played by a second engine over the same real store
//! without faults, probing the key in a loop while the owner runs: if the owner's lease ever
//! ran out, a probe would take the key over and run the operation a second time.
//!
//! Without `TEST_POSTGRES_URL` / `TEST_MYSQL_URL` / `TEST_REDIS_URL` those backends are
//! skipped, unless `TEST_REQUIRE_ALL_BACKENDS=1`.

#[path = "common/backends.rs"]
mod backends;
mod common;
#[path = "common/sqlite_file.rs"]
mod sqlite_file;

use std::{
    any::Any,
    collections::HashSet,
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use bytes::Bytes;
use common::faulty::Faulty;
use tokio::sync::Barrier;
use tower_idempotency::{
    engine::{Begin, Claim, EngineError, Execution, RunError},
    store::Store,
    Engine, Fingerprint, InProgressPolicy, Record, StoreKey, Token,
};

/// Short enough for a quick suite, long enough for a loaded machine: renewals every 350 ms,
/// a failed one retried after 87 ms, each store call bounded by 250 ms.
const LEASE: Duration = Duration::from_millis(1400);
const STORE_TIMEOUT: Duration = Duration::from_millis(250);

fn key() -> StoreKey {
    StoreKey::new(format!("faults-{}", Token::random().to_hex()), "k")
}

fn fingerprint() -> Fingerprint {
    Fingerprint::of([b"the request".as_slice()])
}

fn engine(store: impl Store, policy: InProgressPolicy) -> Engine {
    Engine::builder(store)
        .lease(LEASE)
        .store_timeout(STORE_TIMEOUT)
        .in_progress(policy)
        .build()
        .expect("valid timings")
}

fn waiting() -> InProgressPolicy {
    InProgressPolicy::Wait {
        timeout: Duration::from_secs(20),
    }
}

/// An operation that counts its runs and takes `duration`.
#[derive(Clone, Default)]
struct Operation {
    runs: Arc<AtomicUsize>,
}

impl Operation {
    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    async fn run(&self, duration: Duration) -> Result<Bytes, std::io::Error> {
        let run = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        tokio::time::sleep(duration).await;
        Ok(Bytes::from(format!("run {run}")))
    }
}

/// Another process: claims the key in a loop (never waiting) until `stop`, running the
/// operation whenever it wins. It wins only if the owner's lease ran out.
fn probe(
    store: Arc<dyn Store>,
    key: StoreKey,
    operation: Operation,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    let other = engine(store, InProgressPolicy::Reject);
    tokio::spawn(async move {
        while !stop.load(Ordering::SeqCst) {
            match other.begin(key.clone(), fingerprint()).await {
                Ok(Begin::Run(claim)) => {
                    let output = operation.run(Duration::ZERO).await.unwrap();
                    let _ = claim.complete(output).await;
                }
                Ok(Begin::Replay(_)) => return,
                Err(_) => {}
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
}

/// Claims a fresh key.
async fn own(engine: &Engine, key: &StoreKey) -> Claim {
    match engine.begin(key.clone(), fingerprint()).await.unwrap() {
        Begin::Run(claim) => claim,
        Begin::Replay(_) => panic!("a fresh key was already completed"),
    }
}

/// The owner's side of most scenarios: claims a fresh key through `engine`, lets another
/// process probe the key over the real `store` meanwhile, runs `work` (the faults and the
/// operation), completes, and checks that the claim was never reported lost, that the
/// operation ran exactly once, and that the key is settled.
async fn owner_keeps_its_key<F>(
    engine: &Engine,
    store: &Arc<dyn Store>,
    operation: &Operation,
    work: impl FnOnce() -> F,
) where
    F: Future<Output = Bytes>,
{
    let key = key();
    let claim = own(engine, &key).await;
    let status = claim.status();
    let stop = Arc::new(AtomicBool::new(false));
    let prober = probe(store.clone(), key.clone(), operation.clone(), stop.clone());
    let output = work().await;
    claim.complete(output).await.unwrap();
    stop.store(true, Ordering::SeqCst);
    prober.await.unwrap();
    assert!(!status.is_lost(), "the owner was told it lost the key");
    assert_eq!(operation.runs(), 1, "another process ran it too");
    assert_not_stuck(store, &key).await;
}

/// The key ends settled: completed (replayed from now on) or absent, never left claimed.
async fn assert_not_stuck(store: &Arc<dyn Store>, key: &StoreKey) {
    let record = store.lookup(key).await.expect("lookup");
    assert!(
        !matches!(record, Some(Record::InProgress { .. })),
        "the key is left claimed: {record:?}"
    );
}

/// The store is down before the operation: a typed store error, the operation not run; back
/// up, it runs once and is replayed.
async fn down_before(store: Arc<dyn Store>) {
    let faulty = Faulty::new(store.clone());
    let engine = engine(faulty.clone(), waiting());
    let (key, operation) = (key(), Operation::default());
    faulty.faults.set_down(true);
    let refused = engine
        .run_once(key.clone(), fingerprint(), || operation.run(Duration::ZERO))
        .await;
    assert!(
        matches!(refused, Err(RunError::Engine(EngineError::Store { .. }))),
        "{refused:?}"
    );
    assert_eq!(operation.runs(), 0);
    faulty.faults.set_down(false);
    for _ in 0..2 {
        engine
            .run_once(key.clone(), fingerprint(), || operation.run(Duration::ZERO))
            .await
            .unwrap();
    }
    assert_eq!(operation.runs(), 1);
    assert_not_stuck(&store, &key).await;
    assert_eq!(engine.waiting_keys(), 0);
}

/// The store goes down while the operation runs, for half a lease (renewals fail, then work
/// again): the owner keeps its key, another process never takes it over, the outcome is
/// recorded.
async fn down_during(store: Arc<dyn Store>) {
    let faulty = Faulty::new(store.clone());
    let engine = engine(faulty.clone(), waiting());
    let operation = Operation::default();
    owner_keeps_its_key(&engine, &store, &operation, || async {
        faulty.faults.set_down(true);
        tokio::time::sleep(LEASE / 2).await;
        faulty.faults.set_down(false);
        operation.run(LEASE * 2).await.unwrap()
    })
    .await;
}

/// The store commits the outcome but its answer is lost: the engine confirms with a lookup
/// and reports `Ran`, not `NotRecorded` (issue 9, item 4).
async fn down_after(store: Arc<dyn Store>) {
    let faulty = Faulty::new(store.clone());
    let engine = engine(faulty.clone(), waiting());
    let (key, operation) = (key(), Operation::default());
    faulty
        .faults
        .lose_complete_answers
        .store(1, Ordering::SeqCst);
    let first = engine
        .run_once(key.clone(), fingerprint(), || operation.run(Duration::ZERO))
        .await;
    assert!(
        matches!(&first, Ok(Execution::Ran(_))),
        "a committed outcome was reported as not recorded: {first:?}"
    );
    let again = engine
        .run_once(key.clone(), fingerprint(), || operation.run(Duration::ZERO))
        .await
        .unwrap();
    assert_eq!(again, Execution::Replayed(Bytes::from("run 1")));
    assert_eq!(operation.runs(), 1);
}

/// Every store call made while the operation runs answers slowly (most of the store
/// timeout): the renewal schedule does not drift, the lease never runs out, nothing runs
/// twice. The claim and the complete around it run undelayed: 200 ms of delay plus a real
/// round trip on a loaded CI machine can exceed the 250 ms timeout, which is a different
/// scenario (a failed claim), and the renewals are what this one is about.
async fn slow_store(store: Arc<dyn Store>) {
    let faulty = Faulty::new(store.clone());
    let engine = engine(faulty.clone(), waiting());
    let operation = Operation::default();
    owner_keeps_its_key(&engine, &store, &operation, || async {
        faulty.faults.delay_ms.store(200, Ordering::SeqCst);
        let output = operation.run(LEASE * 3).await.unwrap();
        faulty.faults.delay_ms.store(0, Ordering::SeqCst);
        output
    })
    .await;
}

/// The store turns slower than the renewal interval (so slower than the store timeout, which
/// the builder keeps below it) for everyone: no renewal can land, and the owner is told its
/// claim is lost once the lease is over. The handler checks its `ClaimStatus` before its side
/// effect and gives the key up; the other process, which could not claim while the store was
/// slow, takes the key over once it is fast again and runs the operation: once in all.
async fn slower_than_the_renewal_interval(store: Arc<dyn Store>) {
    let faulty = Faulty::new(store.clone());
    let engine = engine(faulty.clone(), waiting());
    let (key, operation) = (key(), Operation::default());
    let claim = own(&engine, &key).await;
    let status = claim.status();
    faulty.faults.delay_ms.store(400, Ordering::SeqCst);
    let stop = Arc::new(AtomicBool::new(false));
    let prober = probe(
        Arc::new(faulty.clone()),
        key.clone(),
        operation.clone(),
        stop.clone(),
    );
    tokio::time::timeout(LEASE * 3, status.lost())
        .await
        .expect("the owner was never told it lost the key");
    assert_eq!(
        operation.runs(),
        0,
        "the other process ran while the store was slow"
    );
    faulty.faults.delay_ms.store(0, Ordering::SeqCst);
    // The handler's check before its side effect: lost, so it does not run it.
    assert!(status.is_lost());
    let _ = claim.release().await;
    tokio::time::timeout(LEASE * 3, prober)
        .await
        .expect("the other process never took the key over")
        .unwrap();
    stop.store(true, Ordering::SeqCst);
    assert_eq!(operation.runs(), 1);
    assert_not_stuck(&store, &key).await;
}

/// Two renewals in a row fail (`hang`: each hangs until the store timeout), then the store
/// answers again: the lease survives, nothing runs twice, the handler is not told it lost.
async fn two_failed_renewals(store: Arc<dyn Store>, hang: bool) {
    let faulty = Faulty::new(store.clone());
    let engine = engine(faulty.clone(), waiting());
    let operation = Operation::default();
    let failing = if hang {
        &faulty.faults.hang_renewals
    } else {
        &faulty.faults.fail_renewals
    };
    failing.store(2, Ordering::SeqCst);
    owner_keeps_its_key(&engine, &store, &operation, || async {
        operation.run(LEASE * 2).await.unwrap()
    })
    .await;
    assert_eq!(failing.load(Ordering::SeqCst), 0, "both faults were hit");
}

/// The operation blocks its thread for two leases (a synchronous call in an async handler):
/// the renewal runs in its own task and keeps the lease (issue 9, item 3).
async fn blocking_operation(store: Arc<dyn Store>) {
    let engine = engine(store.clone(), waiting());
    let operation = Operation::default();
    owner_keeps_its_key(&engine, &store, &operation, || async {
        operation.runs.fetch_add(1, Ordering::SeqCst);
        // A synchronous call in an async handler: this thread is stuck.
        std::thread::sleep(LEASE * 2);
        Bytes::from("blocked")
    })
    .await;
}

/// 4 keys × 50 duplicates released together while each original runs for half a second:
/// every duplicate that got an answer got the original's output, nothing runs twice, the
/// store is looked up by one watch per key (not by each waiter), and no waiter entry is left
/// (issue 9, items 6, 7).
///
/// The 200 first claims still queue for the pool together (a claim is one store call per
/// request, unavoidably); on a loaded machine some may exceed the store timeout and be
/// answered "store unavailable" without running, which is the layer's promise too. A longer
/// timeout (and the lease it needs) keeps that rare.
async fn duplicate_storm(store: Arc<dyn Store>) {
    const KEYS: usize = 4;
    const COPIES: usize = 50;
    let faulty = Faulty::new(store.clone());
    let engine = Engine::builder(faulty.clone())
        .lease(LEASE * 5)
        .store_timeout(STORE_TIMEOUT * 5)
        .in_progress(waiting())
        .build()
        .unwrap();
    let operation = Operation::default();
    let keys: Vec<StoreKey> = (0..KEYS).map(|_| key()).collect();
    let barrier = Arc::new(Barrier::new(KEYS * COPIES));
    let mut tasks = Vec::new();
    for i in 0..KEYS * COPIES {
        let (engine, key, operation, barrier) = (
            engine.clone(),
            keys[i % KEYS].clone(),
            operation.clone(),
            barrier.clone(),
        );
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let answer = engine
                .run_once(key, fingerprint(), || {
                    operation.run(Duration::from_millis(500))
                })
                .await;
            (i % KEYS, answer)
        }));
    }
    let mut outputs = vec![HashSet::new(); KEYS];
    for task in tasks {
        match task.await.unwrap() {
            (key, Ok(answer)) => {
                outputs[key].insert(answer.into_output());
            }
            (_, Err(RunError::Engine(EngineError::Store { .. }))) => {}
            (_, Err(other)) => panic!("a duplicate failed otherwise: {other:?}"),
        }
    }
    for answers in &outputs {
        assert!(answers.len() <= 1, "one key, several outputs: {answers:?}");
    }
    let answered = outputs.iter().filter(|a| !a.is_empty()).count();
    assert!(answered > 0, "the store answered nothing");
    assert_eq!(operation.runs(), answered, "a key ran more than once");
    // One watch per key: a handful of polls each while the original runs (backoff 5, 10,
    // 20 ... ms), plus one look per settled key. Each waiter polling on its own made
    // several per waiter.
    let lookups = faulty.faults.lookups();
    assert!(
        lookups <= KEYS * 20,
        "{lookups} lookups for {KEYS} keys: the waiters did not share one watch per key"
    );
    assert_eq!(engine.waiting_keys(), 0, "a waiter entry leaked");
    for key in &keys {
        assert_not_stuck(&store, key).await;
    }
}

/// Past `max_waiters_per_key`, a duplicate is told to come back (in progress) instead of
/// joining the wait; the original and the admitted waiters are unaffected.
async fn waiter_cap(store: Arc<dyn Store>) {
    let engine = Engine::builder(store.clone())
        .lease(LEASE)
        .store_timeout(STORE_TIMEOUT)
        .max_waiters_per_key(3)
        .build()
        .unwrap();
    let (key, operation) = (key(), Operation::default());
    let claim = own(&engine, &key).await;
    let mut admitted = Vec::new();
    for _ in 0..3 {
        let (engine, key) = (engine.clone(), key.clone());
        admitted.push(tokio::spawn(async move {
            engine.begin(key, fingerprint()).await
        }));
    }
    // Wait until the three have joined (the map counts one key).
    while engine.waiting_keys() == 0 {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let over = engine.begin(key.clone(), fingerprint()).await;
    assert!(
        matches!(over, Err(EngineError::InProgress { .. })),
        "{over:?}"
    );
    let output = operation.run(Duration::ZERO).await.unwrap();
    claim.complete(output).await.unwrap();
    for waiter in admitted {
        assert!(matches!(waiter.await.unwrap(), Ok(Begin::Replay(_))));
    }
    assert_eq!(engine.waiting_keys(), 0);
}

/// Takes every connection of a store's pool and holds them until the returned value drops.
type Hog = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Box<dyn Any + Send>> + Send>> + Send + Sync>;

fn hog<DB: sqlx::Database>(pool: sqlx::Pool<DB>) -> Hog {
    Arc::new(move || {
        let pool = pool.clone();
        Box::pin(async move {
            let mut held = Vec::new();
            for _ in 0..pool.options().get_max_connections() {
                held.push(pool.acquire().await.expect("a pooled connection"));
            }
            Box::new(held) as Box<dyn Any + Send>
        })
    })
}

/// Every pooled connection is taken (by unrelated work) before the operation: the claim
/// times out at the store timeout instead of queueing without bound, nothing runs; once the
/// pool frees up the operation runs once.
async fn pool_exhausted_before(store: Arc<dyn Store>, hog: Hog) {
    let engine = engine(store.clone(), waiting());
    let (key, operation) = (key(), Operation::default());
    let held = hog().await;
    let refused = engine
        .run_once(key.clone(), fingerprint(), || operation.run(Duration::ZERO))
        .await;
    assert!(
        matches!(refused, Err(RunError::Engine(EngineError::Store { .. }))),
        "{refused:?}"
    );
    assert_eq!(operation.runs(), 0);
    drop(held);
    for _ in 0..2 {
        engine
            .run_once(key.clone(), fingerprint(), || operation.run(Duration::ZERO))
            .await
            .unwrap();
    }
    assert_eq!(operation.runs(), 1);
    assert_not_stuck(&store, &key).await;
}

/// The pool is exhausted for half a lease while the operation runs, so renewals time out in
/// a row; once it frees up they succeed again before the lease ends: nothing runs twice.
async fn pool_exhausted_during(store: Arc<dyn Store>, hog: Hog) {
    let engine = engine(store.clone(), waiting());
    let operation = Operation::default();
    owner_keeps_its_key(&engine, &store, &operation, || async {
        let held = hog().await;
        tokio::time::sleep(LEASE / 2).await;
        drop(held);
        operation.run(LEASE).await.unwrap()
    })
    .await;
    assert_eq!(engine.waiting_keys(), 0);
}

/// One `#[tokio::test]` per `name => scenario`, each on a store opened by `$open` (skipped
/// when that backend is not configured).
macro_rules! scenarios {
    ($open:expr; $($name:ident => $scenario:expr),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                if let Some(opened) = $open {
                    ($scenario)(opened).await;
                }
            }
        )*
    };
}

macro_rules! pool_suite {
    ($backend:ident, $open:expr) => {
        mod $backend {
            use super::*;

            scenarios!($open;
                pool_exhausted_before_the_operation =>
                    |(store, hog)| pool_exhausted_before(store, hog),
                pool_exhausted_during_the_operation =>
                    |(store, hog)| pool_exhausted_during(store, hog),
            );
        }
    };
}

macro_rules! fault_suite {
    ($backend:ident, $open:expr) => {
        mod $backend {
            use super::*;

            scenarios!($open;
                store_down_before_the_operation => down_before,
                store_down_during_the_operation => down_during,
                store_answer_lost_after_the_operation => down_after,
                slow_store => super::slow_store,
                store_slower_than_the_renewal_interval => slower_than_the_renewal_interval,
                two_renewals_fail_in_a_row => |store| two_failed_renewals(store, false),
                two_renewals_hang_in_a_row => |store| two_failed_renewals(store, true),
                a_blocking_operation_keeps_its_lease => blocking_operation,
                duplicate_storm_shares_one_watch_per_key => duplicate_storm,
                waiters_beyond_the_cap_are_told_to_come_back => waiter_cap,
            );
        }
    };
}

async fn memory() -> Option<Arc<dyn Store>> {
    Some(Arc::new(tower_idempotency::store::MemoryStore::new()))
}

async fn sqlite() -> Option<(Arc<dyn Store>, Hog)> {
    let path = sqlite_file::fresh_path("faults");
    let store = tower_idempotency::store::SqliteStore::open(&path)
        .await
        .expect("open a SQLite file");
    store.migrate().await.expect("migrate");
    Some((Arc::new(store.clone()), hog(store.pool().clone())))
}

/// A small pool on the server named by `var`, or `None` when it is unset (skipped).
async fn pool<DB: sqlx::Database>(var: &str) -> Option<sqlx::Pool<DB>> {
    let url = backends::url_or_skip(var)?;
    let pool = sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(8)
        .connect(&url)
        .await;
    Some(pool.unwrap_or_else(|e| panic!("{var} is set but unreachable: {e}")))
}

async fn postgres() -> Option<(Arc<dyn Store>, Hog)> {
    let store = tower_idempotency::store::PostgresStore::new(pool("TEST_POSTGRES_URL").await?);
    store.migrate().await.expect("migrate");
    Some((Arc::new(store.clone()), hog(store.pool().clone())))
}

async fn mysql() -> Option<(Arc<dyn Store>, Hog)> {
    let store = tower_idempotency::store::MySqlStore::new(pool("TEST_MYSQL_URL").await?);
    store.migrate().await.expect("migrate");
    Some((Arc::new(store.clone()), hog(store.pool().clone())))
}

async fn redis() -> Option<Arc<dyn Store>> {
    let url = backends::url_or_skip("TEST_REDIS_URL")?;
    let store = tower_idempotency::store::RedisStore::builder()
        .prefix(format!(
            "tower-idempotency-faults:{}:",
            Token::random().to_hex()
        ))
        .open(&url)
        .await
        .expect("TEST_REDIS_URL is set but unreachable");
    Some(Arc::new(store))
}

fault_suite!(memory_store, memory().await);
fault_suite!(sqlite_store, sqlite().await.map(|(store, _)| store));
fault_suite!(postgres_store, postgres().await.map(|(store, _)| store));
fault_suite!(mysql_store, mysql().await.map(|(store, _)| store));
pool_suite!(sqlite_pool, sqlite().await);
pool_suite!(postgres_pool, postgres().await);
pool_suite!(mysql_pool, mysql().await);
fault_suite!(redis_store, redis().await);

/// Many waiters of one key woken together leave no entry behind (issue 9, item 6): the last
/// one out removes the key, however their drops interleave. 200 rounds of 8 waiters on a
/// multi-threaded runtime, each round's waiters released by one completion.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiter_entries_do_not_leak_when_waiters_wake_together() {
    let engine = engine(tower_idempotency::store::MemoryStore::new(), waiting());
    for _ in 0..200 {
        let key = key();
        let claim = own(&engine, &key).await;
        let barrier = Arc::new(Barrier::new(9));
        let waiters: Vec<_> = (0..8)
            .map(|_| {
                let (engine, key, barrier) = (engine.clone(), key.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    engine.begin(key, fingerprint()).await
                })
            })
            .collect();
        barrier.wait().await;
        while engine.waiting_keys() == 0 {
            tokio::task::yield_now().await;
        }
        claim.complete(Bytes::from("done")).await.unwrap();
        for waiter in waiters {
            assert!(matches!(waiter.await.unwrap(), Ok(Begin::Replay(_))));
        }
    }
    assert_eq!(engine.waiting_keys(), 0, "waiter entries leaked");
}

/// A claim cut off from its store for longer than its lease is reported lost to its owner
/// (`ClaimStatus`), so the handler can stop before an irreversible step; a claim whose
/// renewals succeed is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_cut_off_past_its_lease_is_reported_lost() {
    let faulty = Faulty::new(Arc::new(tower_idempotency::store::MemoryStore::new()));
    let engine = engine(faulty.clone(), waiting());
    let kept = own(&engine, &key()).await;
    let cut_off = own(&engine, &key()).await;
    let (kept_status, status) = (kept.status(), cut_off.status());
    assert!(!status.is_lost());
    faulty.faults.set_down(true);
    tokio::time::timeout(LEASE * 3, status.lost())
        .await
        .expect("the owner was never told its lease ran out");
    assert!(status.is_lost());
    // The other claim's lease ends at about the same moment, told by its own renewal.
    tokio::time::timeout(LEASE, kept_status.lost())
        .await
        .expect("same store, same outage: both leases ran out");
    faulty.faults.set_down(false);
    let fresh = own(&engine, &key()).await;
    tokio::time::sleep(LEASE * 2).await;
    assert!(!fresh.status().is_lost(), "renewed claims are not lost");
    let _ = fresh.release().await;
}
