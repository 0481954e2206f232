//! The MariaDB side of the unknown commit outcome: a transactional owner that never hears
//! its `COMMIT`'s answer must say the outcome is unknown (503 `outcome-unknown` +
//! `Retry-After`, counted in the metrics), and one whose session the server killed before
//! the `COMMIT` must not claim success; either way the retry with the same key learns the
//! outcome and the effect lands once. Real MariaDB; effects counted in the database.
//!
//! - Committed, answer lost: the owner's connection passes through a proxy that forwards
//!   the `COMMIT` (sqlx sends it as the text query `COMMIT`) and then nothing back, cutting
//!   the connection 200 ms later. The server commits; the retry replays.
//! - Killed before the commit: `KILL <id>` from a second connection while the handler waits
//!   inside the transaction. Nothing commits (the record's `UPDATE` fails before any
//!   `COMMIT` is sent), so the answer is `not-committed`, and the retry runs once.
//!
//! Not covered: a `KILL` that lands while the server runs the `COMMIT` itself (MariaDB error
//! 1927, read as outcome-unknown by `src/transactional/unknown.rs`). A local MariaDB without
//! a binary log commits too fast to be caught there, and it has no commit-time trigger.
//!
//! One test in a binary of its own: it installs the global metrics recorder.

#![cfg(all(feature = "mysql", feature = "axum", feature = "metrics"))]

#[path = "common/backends.rs"]
mod backends;
#[path = "common/commit_answers.rs"]
mod commit_answers;
#[path = "common/effects_table.rs"]
mod effects_table;
#[path = "common/proxy.rs"]
mod proxy;

use std::time::{Duration, Instant};

use axum::{
    http::{HeaderMap, StatusCode},
    routing::post,
    Router,
};
use commit_answers::{assert_retryable_503, counter, send, OUTCOME_UNKNOWN, STORE_TIMEOUT};
use metrics_exporter_prometheus::PrometheusBuilder;
use proxy::Proxy;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use tokio::sync::{mpsc, oneshot};
use tower_idempotency::{store::MySqlStore, transactional::Tx, IdempotencyLayer, StoreKey, Token};

/// How long the proxy keeps the hushed connection open after forwarding the `COMMIT`:
/// ample for a local server to commit, short for the test.
const CUT_AFTER: Duration = Duration::from_millis(200);

/// The series of the `not-committed` answer.
const NOT_COMMITTED: &str =
    "idempotency_requests_total{outcome=\"rejected\",reason=\"not_committed\"}";

/// A handler waiting inside its transaction hands the test its connection id and a way to
/// let it go on.
type Parked = (u64, oneshot::Sender<()>);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mariadb_commit_lost_or_killed_is_answered_truthfully_and_learned_by_the_retry() {
    let Some(url) = backends::url_or_skip("TEST_MYSQL_URL") else {
        return;
    };
    let recorder = PrometheusBuilder::new().build_recorder();
    let metrics = recorder.handle();
    metrics::set_global_recorder(recorder).expect("the only recorder of this binary");
    let options: MySqlConnectOptions = url.parse().expect("TEST_MYSQL_URL");
    let store = open(options.clone()).await;
    store.migrate().await.expect("migrate");
    let table = effects_table::create(store.pool(), "tx_unknown").await;

    // Committed, answer lost.
    let proxy = Proxy::start(options.get_host(), options.get_port()).await;
    let proxied = open(options.host("127.0.0.1").port(proxy.addr().port())).await;
    let key = StoreKey::new("tx-unknown", Token::random().to_hex());
    let (app, _) = route(&proxied, &table);
    proxy.hush_after(b"COMMIT", CUT_AFTER);
    let started = Instant::now();
    let answer = send(app.clone(), key.key().to_owned(), None).await;
    // The store time limit also answers `outcome-unknown`: tell that cause from the cut.
    assert!(
        started.elapsed() < STORE_TIMEOUT,
        "the answer came after {:?}: from the store time limit, not from the cut",
        started.elapsed()
    );
    proxy.wait_hushed(Duration::from_secs(1)).await;
    let detail = assert_retryable_503(&answer, "urn:tower-idempotency:outcome-unknown");
    assert!(
        detail.contains("outcome unknown; retry with the same key"),
        "{detail}"
    );
    assert_eq!(counter(&metrics.render(), OUTCOME_UNKNOWN), 1);
    // The server did commit: effect and record, together.
    assert_eq!(effects(&store, &table, &key).await, 1);
    assert_eq!(records(&store, &key).await, 1);
    // The retry, on a new connection through the (now plain) proxy, replays it.
    let (status, _, body) = send(app, key.key().to_owned(), None).await;
    assert_eq!((status, &body[..]), (StatusCode::CREATED, &b"charged"[..]));
    assert_eq!(effects(&store, &table, &key).await, 1);
    assert_eq!(counter(&metrics.render(), OUTCOME_UNKNOWN), 1);

    // Killed before the commit.
    let key = StoreKey::new("tx-unknown", Token::random().to_hex());
    let (app, mut parked) = route(&store, &table);
    let first = tokio::spawn(send(
        app.clone(),
        key.key().to_owned(),
        Some(("x-park", "1".to_owned())),
    ));
    let (id, go_on) = parked.recv().await.expect("the parked handler");
    sqlx::query(sqlx::AssertSqlSafe(format!("KILL {id}")))
        .execute(store.pool())
        .await
        .expect("kill the owner's session");
    go_on.send(()).expect("the handler still waits");
    let answer = first.await.expect("the first request's task");
    let detail = assert_retryable_503(&answer, "urn:tower-idempotency:not-committed");
    assert!(detail.contains("nothing of it persists"), "{detail}");
    let rendered = metrics.render();
    assert_eq!(counter(&rendered, NOT_COMMITTED), 1);
    assert_eq!(counter(&rendered, OUTCOME_UNKNOWN), 1);
    // The kill rolled the transaction back, claim included: the key is free.
    assert_eq!(effects(&store, &table, &key).await, 0);
    assert_eq!(records(&store, &key).await, 0);
    // The retry runs, once; the next one replays it.
    let (status, _, body) = send(app.clone(), key.key().to_owned(), None).await;
    assert_eq!((status, &body[..]), (StatusCode::CREATED, &b"charged"[..]));
    let (again, _, replayed) = send(app, key.key().to_owned(), None).await;
    assert_eq!((again, replayed), (status, body));
    assert_eq!(effects(&store, &table, &key).await, 1);
}

/// A store on a small pool of its own.
async fn open(options: MySqlConnectOptions) -> MySqlStore {
    let pool = MySqlPoolOptions::new()
        .max_connections(3)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await
        .expect("TEST_MYSQL_URL is set but unreachable");
    MySqlStore::new(pool)
}

/// How many effects `table` holds for `key`.
async fn effects(store: &MySqlStore, table: &str, key: &StoreKey) -> i64 {
    effects_table::count_rows(store.pool(), table, "k", key).await
}

/// How many records `key` has in the store's table.
async fn records(store: &MySqlStore, key: &StoreKey) -> i64 {
    effects_table::count_rows(store.pool(), "tower_idempotency_records", "`key`", key).await
}

/// A transactional route whose handler writes one effect row for the request's key and
/// answers 201 `charged`; with `x-park`, it then waits inside its transaction, having sent
/// its connection id to the receiver, until the test lets it go on.
fn route(store: &MySqlStore, table: &str) -> (Router, mpsc::UnboundedReceiver<Parked>) {
    let table = table.to_owned();
    let (park, parked) = mpsc::unbounded_channel();
    let handler = move |mut tx: Tx<sqlx::MySql>, headers: HeaderMap| {
        let (table, park) = (table.clone(), park.clone());
        async move {
            let key = headers["idempotency-key"].to_str().unwrap().to_owned();
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {table} (k) VALUES (?)"
            )))
            .bind(key)
            .execute(&mut *tx)
            .await
            .unwrap();
            if headers.contains_key("x-park") {
                let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
                let (go_on, wait) = oneshot::channel();
                park.send((id, go_on)).unwrap();
                wait.await.unwrap();
            }
            (StatusCode::CREATED, "charged")
        }
    };
    let layer = IdempotencyLayer::transactional(commit_answers::transactional(store))
        .require_key()
        .scope_with(|_| "tx-unknown".to_owned());
    (Router::new().route("/", post(handler)).layer(layer), parked)
}
