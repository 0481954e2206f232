//! Store outages against real servers, played with a TCP proxy between the layer and the
//! server (`common::proxy`): while the store is unreachable the layer fails closed (503, the
//! handler does not run); once it is back the same service, with the same pool, recovers by
//! itself. Every test counts handler executions, not just statuses.
//!
//! ```text
//! TEST_POSTGRES_URL=postgres://root@127.0.0.1/test TEST_REDIS_URL=redis://127.0.0.1:6379 \
//!     cargo test --test store_faults
//! ```
//!
//! Without the URLs the tests are skipped, unless `TEST_REQUIRE_ALL_BACKENDS=1`.
#![cfg(feature = "postgres")]

mod common;
mod conformance;

use std::{
    error::Error,
    str::FromStr,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use axum::{
    extract::State,
    http::{header, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
    Router,
};
use bytes::Bytes;
use common::{app, layer_with, post_req, proxy::Proxy, send, Answer, Runs};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tower_idempotency::{
    engine::{EngineError, Execution, RunError},
    store::{PostgresStore, StoreError},
    Engine, Fingerprint, IdempotencyLayer, InProgressPolicy, StoreKey, Token,
};

/// How long a pool waits for a connection: short, so a test never hangs on a down store.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(1);

/// A Postgres store whose only way to the server is through a proxy the test controls.
struct Pg {
    proxy: Proxy,
    store: PostgresStore,
}

/// A migrated store on a fresh pool through a fresh proxy, or `None` when
/// `TEST_POSTGRES_URL` is unset (or the server unreachable) and the test is skipped.
async fn postgres() -> Option<Pg> {
    postgres_with(true).await
}

/// [`postgres`], choosing whether the pool pings a pooled connection before handing it out.
async fn postgres_with(test_before_acquire: bool) -> Option<Pg> {
    let url = conformance::url_or_skip("TEST_POSTGRES_URL")?;
    let options = PgConnectOptions::from_str(&url).expect("TEST_POSTGRES_URL is not a valid URL");
    assert!(
        !options.get_host().starts_with('/'),
        "TEST_POSTGRES_URL must name a TCP host, not a Unix socket, for the proxy to sit in between"
    );
    let proxy = Proxy::start(options.get_host(), options.get_port()).await;
    let through_proxy = options.host("127.0.0.1").port(proxy.addr().port());
    let pool = match PgPoolOptions::new()
        .max_connections(4)
        .min_connections(0)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        // On by default: a pooled connection is pinged before use, so one killed by the
        // outage is replaced rather than failing the next query.
        .test_before_acquire(test_before_acquire)
        .connect_with(through_proxy)
        .await
    {
        Ok(pool) => pool,
        Err(error) if conformance::require_all() => {
            panic!("TEST_POSTGRES_URL is set but the server is unreachable: {error}")
        }
        Err(error) => {
            eprintln!("skipped: TEST_POSTGRES_URL is set but the server is unreachable: {error}");
            return None;
        }
    };
    let store = PostgresStore::new(pool);
    store.migrate().await.expect("migrate through the proxy");
    Some(Pg { proxy, store })
}

/// A key no earlier run of these tests used: the table outlives the test process.
fn fresh_key() -> String {
    format!("fault-{}", Token::random().to_hex())
}

fn assert_store_unavailable(answer: &Answer, retry_after: &str) {
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
    assert_eq!(
        answer.problem_type(),
        "urn:tower-idempotency:store-unavailable"
    );
    assert_eq!(
        answer.headers[header::RETRY_AFTER],
        retry_after,
        "{answer:?}"
    );
}

/// Status and body, readable in a failure message.
fn outcome(answer: &Answer) -> (StatusCode, String) {
    (
        answer.status,
        String::from_utf8_lossy(&answer.body).into_owned(),
    )
}

/// Store down: requests with a key are refused with 503 and never reach the handler; requests
/// without a key are not protected, so they still run. Store back: the very same service and
/// pool run the request once and replay its duplicate.
#[tokio::test]
async fn postgres_down_answers_503_without_running_then_recovers() {
    let Some(pg) = postgres().await else { return };
    let runs = Runs::default();
    let layer = layer_with(pg.store.clone(), |e| e.retry_after(Duration::from_secs(2)));
    let app = app(layer, runs.clone());
    let key = fresh_key();

    pg.proxy.cut();
    for _ in 0..2 {
        let answer = send(&app, post_req("/pay", Some(&key), "{}")).await;
        assert_store_unavailable(&answer, "2");
    }
    assert_eq!(runs.count(), 0, "the handler ran without a claim");
    assert!(
        pg.proxy.turned_away() >= 1,
        "the store was never asked: the 503 did not come from the outage"
    );
    let unprotected = send(&app, post_req("/pay", None, "{}")).await;
    assert_eq!(unprotected.status, StatusCode::CREATED);
    assert_eq!(runs.count(), 1, "a request without a key needs no store");

    pg.proxy.restore();
    let first = send(&app, post_req("/pay", Some(&key), "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(first.headers["x-run"], "2");
    assert_eq!(runs.count(), 2);
    let duplicate = send(&app, post_req("/pay", Some(&key), "{}")).await;
    assert_eq!(duplicate.status, StatusCode::CREATED);
    assert_eq!(
        duplicate.headers["x-run"], "2",
        "not a replay: {duplicate:?}"
    );
    assert_eq!(duplicate.body, first.body);
    assert_eq!(runs.count(), 2, "the duplicate ran again");
}

/// What `POST /cut` does to the store while it runs.
#[derive(Clone, Copy)]
enum Outage {
    /// Cut, and restore once the proxy has turned `n` connection attempts away — that is,
    /// once the layer's first write of the outcome has certainly failed.
    RestoreAfterTurnedAway(usize),
    /// Cut and leave it to the test to restore.
    StayDown,
}

#[derive(Clone)]
struct Cutter {
    runs: Runs,
    proxy: Proxy,
    outage: Outage,
}

/// `POST /cut`: counts a run; on the first run only, cuts the store off (see [`Outage`]);
/// answers 201 with the run number.
fn cutting_app(layer: IdempotencyLayer, cutter: Cutter) -> Router {
    Router::new()
        .route("/cut", post(cut_handler))
        .with_state(cutter)
        .layer(layer)
}

async fn cut_handler(State(cutter): State<Cutter>) -> Response {
    let run = cutter.runs.0.fetch_add(1, Ordering::SeqCst) + 1;
    if run == 1 {
        let before = cutter.proxy.turned_away();
        cutter.proxy.cut();
        if let Outage::RestoreAfterTurnedAway(n) = cutter.outage {
            let proxy = cutter.proxy.clone();
            tokio::spawn(async move {
                proxy
                    .wait_turned_away(before + n, Duration::from_secs(10))
                    .await;
                proxy.restore();
            });
        }
    }
    (StatusCode::CREATED, format!("run {run}")).into_response()
}

/// The store goes down while the handler runs and comes back shortly after: the caller gets
/// the handler's real response, and the engine's retries of `complete` record it once the
/// store is back, so a duplicate replays instead of running again.
///
/// The proxy is restored once it has turned away the first attempt to record the outcome
/// (rather than after a fixed delay), so the test knows that first write failed and it was a
/// retry that recorded it.
#[tokio::test]
async fn postgres_cut_mid_flight_is_recorded_by_the_retries() {
    let Some(pg) = postgres().await else { return };
    let runs = Runs::default();
    let cutter = Cutter {
        runs: runs.clone(),
        proxy: pg.proxy.clone(),
        outage: Outage::RestoreAfterTurnedAway(1),
    };
    // Reject: a duplicate of an unrecorded outcome answers 409 at once instead of waiting.
    let layer = layer_with(pg.store.clone(), |e| {
        e.in_progress(InProgressPolicy::Reject)
    });
    let app = cutting_app(layer, cutter);
    let key = fresh_key();

    let first = send(&app, post_req("/cut", Some(&key), "")).await;
    assert_eq!(outcome(&first), (StatusCode::CREATED, "run 1".to_owned()));
    assert!(
        pg.proxy.turned_away() >= 1,
        "the outcome was written before the cut took effect"
    );
    let duplicate = send(&app, post_req("/cut", Some(&key), "")).await;
    assert_eq!(
        outcome(&duplicate),
        (StatusCode::CREATED, "run 1".to_owned()),
        "the outcome was not recorded: {duplicate:?}"
    );
    assert_eq!(runs.count(), 1);
}

/// The store goes down while the handler runs and stays down past every retry of `complete`.
///
/// - The caller still gets the handler's real response (201): the work was done, and hiding
///   it would make the client retry into the gap below.
/// - The key stays claimed (in progress) until its lease runs out, since the owner could
///   neither record the outcome nor release the key, and no longer renews the lease. Until
///   then a duplicate waits (default policy) or gets 409 + `Retry-After` (reject policy);
///   it does not run.
/// - After the lease runs out the key counts as absent: the next duplicate — including one
///   that was waiting — runs the handler a second time, and that outcome is replayed.
///
/// So an outage longer than the retries costs one possible re-execution, bounded by the
/// lease, never a duplicate running in parallel with the original.
#[tokio::test]
async fn postgres_down_past_the_retries_reruns_after_the_lease() {
    let Some(pg) = postgres().await else { return };
    let runs = Runs::default();
    let cutter = Cutter {
        runs: runs.clone(),
        proxy: pg.proxy.clone(),
        outage: Outage::StayDown,
    };
    // Long enough for the 409 below to be sent well within it, short for the test's run time.
    let lease = Duration::from_secs(3);
    let rejecting = cutting_app(
        layer_with(pg.store.clone(), |e| {
            e.lease(lease)
                .store_timeout(Duration::from_millis(500))
                .in_progress(InProgressPolicy::Reject)
        }),
        cutter.clone(),
    );
    let waiting = cutting_app(
        layer_with(pg.store.clone(), |e| {
            e.lease(lease)
                .store_timeout(Duration::from_millis(500))
                .in_progress(InProgressPolicy::Wait {
                    timeout: Duration::from_secs(15),
                })
        }),
        cutter,
    );
    let key = fresh_key();

    let first = send(&rejecting, post_req("/cut", Some(&key), "")).await;
    assert_eq!(outcome(&first), (StatusCode::CREATED, "run 1".to_owned()));
    assert!(
        pg.proxy.turned_away() >= 2,
        "the engine did not retry writing the outcome"
    );
    pg.proxy.restore();

    let rejected = send(&rejecting, post_req("/cut", Some(&key), "")).await;
    assert_eq!(rejected.status, StatusCode::CONFLICT, "{rejected:?}");
    assert_eq!(rejected.problem_type(), "urn:tower-idempotency:in-progress");
    assert!(rejected.headers.contains_key(header::RETRY_AFTER));
    assert_eq!(runs.count(), 1);

    // Waits out the rest of the lease, then takes the key over and runs.
    let rerun = send(&waiting, post_req("/cut", Some(&key), "")).await;
    assert_eq!(outcome(&rerun), (StatusCode::CREATED, "run 2".to_owned()));
    assert_eq!(runs.count(), 2);

    let replay = send(&rejecting, post_req("/cut", Some(&key), "")).await;
    assert_eq!(outcome(&replay), (StatusCode::CREATED, "run 2".to_owned()));
    assert_eq!(runs.count(), 2);
}

/// Without HTTP: `Engine::run_once` on a store that is down reports a typed store error
/// whose sources lead to the driver's error, and does not call the operation; once the store
/// is back the same engine runs it once and replays it.
#[tokio::test]
async fn postgres_down_engine_run_once_is_a_typed_store_error() {
    let Some(pg) = postgres().await else { return };
    let engine = Engine::builder(pg.store.clone())
        .retry_after(Duration::from_secs(3))
        .build()
        .unwrap();
    let key = StoreKey::new(format!("faults-{}", Token::random().to_hex()), "message-1");
    let fingerprint = Fingerprint::of([b"payload".as_slice()]);
    let calls = Arc::new(AtomicUsize::new(0));
    let run = || {
        let calls = calls.clone();
        engine.run_once(key.clone(), fingerprint, move || async move {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            Ok::<_, std::io::Error>(Bytes::from(format!("call {n}")))
        })
    };

    pg.proxy.cut();
    let error = run().await.expect_err("ran on a store that is down");
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the operation was called");
    let RunError::Engine(EngineError::Store {
        retry_after,
        source: ref store_error,
    }) = error
    else {
        panic!("expected a store error, got {error:?}");
    };
    assert_eq!(retry_after, Duration::from_secs(3));
    assert!(
        matches!(
            store_error,
            StoreError::Backend {
                backend: "postgres",
                ..
            }
        ),
        "{store_error:?}"
    );
    let sqlx_error = std::iter::successors(Some(&error as &dyn Error), |&e| e.source())
        .find_map(|e| e.downcast_ref::<sqlx::Error>())
        .unwrap_or_else(|| panic!("no sqlx::Error among the sources of {error:?}"));
    assert!(
        matches!(sqlx_error, sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut),
        "not a connection failure: {sqlx_error:?}"
    );

    pg.proxy.restore();
    let ran = run().await.expect("the store is back");
    assert_eq!(ran, Execution::Ran(Bytes::from("call 1")));
    let replayed = run().await.expect("the store is back");
    assert_eq!(replayed, Execution::Replayed(Bytes::from("call 1")));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// The network goes silent before a request (nothing is closed, no byte gets through): the
/// pool's ping before use hangs, `acquire_timeout` ends it, and the layer answers 503 without
/// running the handler. Once the network is back the same service recovers.
#[tokio::test]
async fn postgres_silent_network_answers_503_within_the_acquire_timeout() {
    let Some(pg) = postgres().await else { return };
    let runs = Runs::default();
    let app = app(IdempotencyLayer::new(pg.store.clone()), runs.clone());
    let key = fresh_key();

    pg.proxy.stall();
    let answer = tokio::time::timeout(
        ACQUIRE_TIMEOUT * 5,
        send(&app, post_req("/pay", Some(&key), "{}")),
    )
    .await
    .expect("no answer: the request hangs on a silent store");
    assert_store_unavailable(&answer, "1");
    assert_eq!(runs.count(), 0, "the handler ran without a claim");

    pg.proxy.restore();
    let first = send(&app, post_req("/pay", Some(&key), "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let duplicate = send(&app, post_req("/pay", Some(&key), "{}")).await;
    assert_eq!(
        duplicate.headers["x-run"], "1",
        "not a replay: {duplicate:?}"
    );
    assert_eq!(runs.count(), 1);
}

/// The network goes silent (nothing is closed, no byte gets through) after the pool handed a
/// connection out, so the claim's query waits for an answer that never comes. sqlx's
/// `acquire_timeout` does not cover this; the engine's per-call `store_timeout` does: 503,
/// the handler not run. (The pool's ping before use is off here to open the window
/// deterministically.)
#[tokio::test]
async fn postgres_stall_after_acquire_answers_503_in_bounded_time() {
    let Some(pg) = postgres_with(false).await else {
        return;
    };
    let runs = Runs::default();
    let layer = layer_with(pg.store.clone(), |e| {
        e.store_timeout(Duration::from_millis(500))
    });
    let app = app(layer, runs.clone());
    // The migration's connection goes back to the pool in the background: wait for it, so the
    // stall starts after the pool's own traffic.
    tokio::time::timeout(Duration::from_secs(5), async {
        while pg.store.pool().num_idle() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the migration's connection never went back to the pool");

    pg.proxy.stall();
    let answer = tokio::time::timeout(
        Duration::from_secs(5),
        send(&app, post_req("/pay", Some(&fresh_key()), "{}")),
    )
    .await
    .expect("no answer within 5 s: the request hangs on a stalled store");
    assert_store_unavailable(&answer, "1");
    assert_eq!(runs.count(), 0, "the handler ran without a claim");
    pg.proxy.restore();
}

/// The same outage with Redis: while cut, 503 and the handler does not run; once restored,
/// the very same store (its connection manager reconnects by itself) runs the request once
/// and replays its duplicate.
#[tokio::test]
async fn redis_down_answers_503_without_running_then_recovers() {
    let Some(url) = conformance::url_or_skip("TEST_REDIS_URL") else {
        return;
    };
    let info = redis::IntoConnectionInfo::into_connection_info(url.as_str())
        .expect("TEST_REDIS_URL is not a valid URL");
    let redis::ConnectionAddr::Tcp(host, port) = info.addr().clone() else {
        panic!("TEST_REDIS_URL must name a TCP host for the proxy to sit in between");
    };
    let proxy = Proxy::start(&host, port).await;
    let through_proxy = format!("redis://127.0.0.1:{}", proxy.addr().port());
    let store = tower_idempotency::store::RedisStore::open(&through_proxy)
        .await
        .expect("Redis through the proxy");
    let runs = Runs::default();
    let layer = layer_with(store, |e| e.retry_after(Duration::from_secs(2)));
    let app = app(layer, runs.clone());
    let key = fresh_key();

    proxy.cut();
    for _ in 0..2 {
        let answer = send(&app, post_req("/pay", Some(&key), "{}")).await;
        assert_store_unavailable(&answer, "2");
    }
    assert_eq!(runs.count(), 0, "the handler ran without a claim");

    proxy.restore();
    let first = send(&app, post_req("/pay", Some(&key), "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let duplicate = send(&app, post_req("/pay", Some(&key), "{}")).await;
    assert_eq!(
        duplicate.headers["x-run"], "1",
        "not a replay: {duplicate:?}"
    );
    assert_eq!(duplicate.body, first.body);
    assert_eq!(runs.count(), 1);
}
