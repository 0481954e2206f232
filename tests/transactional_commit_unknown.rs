//! A transactional owner whose connection is killed while its `COMMIT` runs cannot know
//! whether it committed: it must say so (503 `outcome-unknown` + `Retry-After`, counted in
//! the metrics), not "nothing persists", and the key must not be left so that a retry runs
//! the effect twice. Real PostgreSQL: a deferred constraint trigger makes the `COMMIT` sleep,
//! and a second connection terminates the owner's backend during that sleep. Effects are
//! counted in the database.
//!
//! Killed inside the trigger, the transaction did not commit, so the retry runs once. Cut off
//! at a proxy while the server still sleeps in the trigger, it commits anyway, and the retry
//! replays it.
//!
//! One test in a binary of its own: it installs the global metrics recorder.

#![cfg(all(feature = "postgres", feature = "axum", feature = "metrics"))]

#[path = "common/backends.rs"]
mod backends;
#[path = "common/commit_answers.rs"]
mod commit_answers;
#[path = "common/effects_table.rs"]
mod effects_table;
#[path = "common/pg_effects.rs"]
mod pg_effects;
#[path = "common/proxy.rs"]
mod proxy;

use std::time::{Duration, Instant};

use axum::{
    http::{header, HeaderMap, StatusCode},
    routing::post,
    Router,
};
use commit_answers::{assert_retryable_503, counter, OUTCOME_UNKNOWN, STORE_TIMEOUT};
use metrics_exporter_prometheus::PrometheusBuilder;
use proxy::Proxy;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::mpsc;
use tower_idempotency::{
    store::PostgresStore, transactional::Tx, IdempotencyLayer, StoreKey, Token,
};

/// How long the trigger sleeps in the owner's `COMMIT`: far longer than the kill takes.
const COMMIT_SLEEP_SECS: u32 = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_connection_breaks_answers_outcome_unknown_and_its_retry_learns_it() {
    let Some((store, table)) = pg_effects::store_and_table(4, "tx_unknown").await else {
        return;
    };
    let recorder = PrometheusBuilder::new().build_recorder();
    let metrics = recorder.handle();
    metrics::set_global_recorder(recorder).expect("the only recorder of this binary");
    slow_commits(&store, &table).await;

    let key = StoreKey::new("tx-unknown", Token::random().to_hex());
    let (app, mut pids) = route(&store, &table, &key);

    // The first request: its COMMIT sleeps in the trigger until it is killed.
    let first = tokio::spawn(send(
        app.clone(),
        key.key().to_owned(),
        Some(COMMIT_SLEEP_SECS),
    ));
    let started = Instant::now();
    let pid = pids.recv().await.expect("the slow handler's backend");
    sleeping_in_commit(&store, pid).await;
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(store.pool())
        .await
        .expect("terminate the owner's backend");
    assert!(terminated, "the owner's backend {pid} was not terminated");
    let answer = first.await.expect("the first request's task");
    assert!(
        started.elapsed() < STORE_TIMEOUT / 2,
        "the answer came after {:?}: from the store time limit, not from the kill",
        started.elapsed()
    );

    let detail = assert_retryable_503(&answer, "urn:tower-idempotency:outcome-unknown");
    assert!(
        detail.contains("outcome unknown; retry with the same key"),
        "{detail}"
    );
    assert_eq!(
        counter(&metrics.render(), OUTCOME_UNKNOWN),
        1,
        "the outcome-unknown answer was not counted"
    );

    // Killed in the trigger, i.e. before the commit point: nothing persisted, and the
    // claim (an advisory lock) ended with the session, so the key is free.
    assert_eq!(pg_effects::effects(&store, &table, &key).await, 0);
    assert_eq!(
        records(&store, &key).await,
        0,
        "a record committed although the COMMIT was killed"
    );

    // The retry with the same key learns it: nothing committed, so it runs, once.
    let (status, _, body) = send(app.clone(), key.key().to_owned(), None).await;
    assert_eq!(status, StatusCode::CREATED, "{body:?}");
    assert_eq!(pg_effects::effects(&store, &table, &key).await, 1);
    // And the next one replays that run.
    let (again, _, replayed) = send(app, key.key().to_owned(), None).await;
    assert_eq!((again, replayed), (status, body));
    assert_eq!(pg_effects::effects(&store, &table, &key).await, 1);
    assert_eq!(counter(&metrics.render(), OUTCOME_UNKNOWN), 1);

    // The other side: the COMMIT goes through, but the connection is cut (at a proxy) while
    // the server still sleeps in it, so the owner never hears the answer.
    let (proxy, proxied) = through_proxy(&store).await;
    let key = StoreKey::new("tx-unknown", Token::random().to_hex());
    let (app, mut pids) = route(&proxied, &table, &key);
    let first = tokio::spawn(send(app.clone(), key.key().to_owned(), Some(1)));
    let pid = pids.recv().await.expect("the slow handler's backend");
    sleeping_in_commit(&store, pid).await;
    proxy.cut();
    let answer = first.await.expect("the first request's task");
    assert_retryable_503(&answer, "urn:tower-idempotency:outcome-unknown");
    assert_eq!(counter(&metrics.render(), OUTCOME_UNKNOWN), 2);
    // The server finishes the sleep and commits: effect and record, together.
    let deadline = Instant::now() + Duration::from_secs(10);
    while records(&store, &key).await == 0 {
        assert!(Instant::now() < deadline, "the cut-off COMMIT never landed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(pg_effects::effects(&store, &table, &key).await, 1);
    // The retry learns it: a replay of the committed answer, not a second run.
    proxy.restore();
    let (status, _, body) = send(app.clone(), key.key().to_owned(), None).await;
    assert_eq!((status, &body[..]), (StatusCode::CREATED, &b"charged"[..]));
    assert_eq!(pg_effects::effects(&store, &table, &key).await, 1);

    // The same break on a request sent without a key: still outcome-unknown (and counted),
    // but nothing records it, so a retry would run it again. The answer says so, and offers
    // no Retry-After: not "retry with the same key".
    let unkeyed = tokio::spawn(send_unkeyed(app, 1));
    let pid = pids.recv().await.expect("the slow handler's backend");
    sleeping_in_commit(&store, pid).await;
    proxy.cut();
    let (status, headers, body) = unkeyed.await.expect("the unkeyed request's task");
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body:?}");
    assert!(headers.get(header::RETRY_AFTER).is_none(), "{headers:?}");
    let problem: serde_json::Value = serde_json::from_slice(&body).expect("problem+json");
    assert_eq!(problem["type"], "urn:tower-idempotency:outcome-unknown");
    let detail = problem["detail"].as_str().unwrap();
    assert!(!detail.contains("same key"), "{detail}");
    assert!(detail.contains("no idempotency key"), "{detail}");
    assert_eq!(counter(&metrics.render(), OUTCOME_UNKNOWN), 3);
    // It did commit: the effect the answer could not confirm is there.
    let deadline = Instant::now() + Duration::from_secs(10);
    while pg_effects::effects(&store, &table, &key).await < 2 {
        assert!(Instant::now() < deadline, "the cut-off COMMIT never landed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends one `POST /` without a key, its commit sleeping `slow` seconds in the trigger.
async fn send_unkeyed(app: Router, slow: u32) -> (StatusCode, HeaderMap, bytes::Bytes) {
    let request = axum::http::Request::post("/")
        .header("x-slow", slow.to_string())
        .body(axum::body::Body::empty())
        .unwrap();
    let response = tower::ServiceExt::oneshot(app, request).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    (parts.status, parts.headers, body)
}

/// How many records `key` has in the store's table.
async fn records(store: &PostgresStore, key: &StoreKey) -> i64 {
    effects_table::count_rows(store.pool(), "tower_idempotency_records", "key", key).await
}

/// A store on the same database as `store`, whose connections pass through a proxy.
async fn through_proxy(store: &PostgresStore) -> (Proxy, PostgresStore) {
    let options = (*store.pool().connect_options()).clone();
    let proxy = Proxy::start(options.get_host(), options.get_port()).await;
    let options = options.host("127.0.0.1").port(proxy.addr().port());
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .expect("connect through the proxy");
    (proxy, PostgresStore::new(pool))
}

/// A deferred constraint trigger on `table`: it fires at `COMMIT` and sleeps there for the
/// seconds the transaction set in `tx_unknown.slow`.
async fn slow_commits(store: &PostgresStore, table: &str) {
    let statements = [
        format!(
            "CREATE FUNCTION {table}_slow() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN \
               IF coalesce(current_setting('tx_unknown.slow', true), '') <> '' THEN \
                 PERFORM pg_sleep(current_setting('tx_unknown.slow')::float8); \
               END IF; \
               RETURN NULL; \
             END $$"
        ),
        format!(
            "CREATE CONSTRAINT TRIGGER {table}_slow AFTER INSERT ON {table} \
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {table}_slow()"
        ),
    ];
    for statement in statements {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(store.pool())
            .await
            .expect("create the slow trigger");
    }
}

/// Waits until backend `pid` sleeps in its commit's trigger (the handler has answered by
/// then, so its only statement left is the record's INSERT with the COMMIT).
async fn sleeping_in_commit(store: &PostgresStore, pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let sleeping: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity \
             WHERE pid = $1 AND wait_event = 'PgSleep' AND strpos(query, 'COMMIT') > 0)",
        )
        .bind(pid)
        .fetch_one(store.pool())
        .await
        .expect("look at pg_stat_activity");
        if sleeping {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the owner never slept in its COMMIT"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A transactional route whose handler writes one effect row for its key, and asks for a
/// commit sleeping `x-slow` seconds when the request says so (sending its backend's pid to
/// the receiver).
fn route(
    store: &PostgresStore,
    table: &str,
    key: &StoreKey,
) -> (Router, mpsc::UnboundedReceiver<i32>) {
    let (table, key) = (table.to_owned(), key.clone());
    let (pids, slow_backends) = mpsc::unbounded_channel();
    let handler = move |mut tx: Tx<sqlx::Postgres>, headers: HeaderMap| {
        let (table, key, pids) = (table.clone(), key.clone(), pids.clone());
        async move {
            if let Some(secs) = headers.get("x-slow") {
                let pid: i32 = sqlx::query_scalar(
                    "SELECT pg_backend_pid() FROM set_config('tx_unknown.slow', $1, true)",
                )
                .bind(secs.to_str().unwrap().to_owned())
                .fetch_one(&mut *tx)
                .await
                .unwrap();
                pids.send(pid).unwrap();
            }
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {table} (k) VALUES ($1)"
            )))
            .bind(key.key())
            .execute(&mut *tx)
            .await
            .unwrap();
            (StatusCode::CREATED, "charged")
        }
    };
    let scope = "tx-unknown".to_owned();
    // The key is optional: an unkeyed request runs in a transaction of its own.
    let layer = IdempotencyLayer::transactional(commit_answers::transactional(store))
        .scope_with(move |_| scope.clone());
    (
        Router::new().route("/", post(handler)).layer(layer),
        slow_backends,
    )
}

/// Sends one keyed request; `slow`: the seconds its commit sleeps in the trigger.
async fn send(
    app: Router,
    key: String,
    slow: Option<u32>,
) -> (StatusCode, HeaderMap, bytes::Bytes) {
    commit_answers::send(app, key, slow.map(|secs| ("x-slow", secs.to_string()))).await
}
