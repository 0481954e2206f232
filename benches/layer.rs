//! The layer's cost per request on the memory store, against the same axum service without
//! it: a new key (claim + run + store), a replay, an unprotected GET, and how soon a waiting
//! duplicate answers after the original finishes (in-process wake-up).

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use axum::{
    body::Body,
    extract::State,
    http::{Request, StatusCode},
    routing::post,
    Router,
};
use criterion::{criterion_group, criterion_main, Criterion};
use http_body_util::BodyExt;
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_idempotency::{store::MemoryStore, IdempotencyLayer};

const BODY: &str = r#"{"amount":1200,"currency":"EUR"}"#;

async fn handler(body: axum::body::Bytes) -> (axum::http::StatusCode, String) {
    (
        axum::http::StatusCode::CREATED,
        format!(r#"{{"id":"pay_1","len":{}}}"#, body.len()),
    )
}

fn request(key: Option<String>) -> Request<Body> {
    let mut builder = Request::post("/payments").header("authorization", "Bearer bench");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder.body(Body::from(BODY)).unwrap()
}

/// Sends `request` and reads the whole answer, which must have status `expected`: a bench
/// that timed refusals (a full store answers 503) would report the wrong path's cost.
async fn call(app: &Router, request: Request<Body>, expected: StatusCode) {
    let response = app.clone().oneshot(request).await.unwrap();
    assert_eq!(
        response.status(),
        expected,
        "the bench measured the wrong path"
    );
    let _ = response.into_body().collect().await.unwrap();
}

/// A memory store for the new-key loop: criterion runs it for seconds, millions of distinct
/// keys, more than the default 256 MiB budget holds (a full store refuses new keys).
fn roomy_store() -> MemoryStore {
    MemoryStore::builder().max_bytes(8 << 30).build()
}

fn bench_layer(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // `with_state(())` is what `axum::serve` does once per connection: each handler becomes
    // a route (with the layer applied) now. Without it axum rebuilds the route, and applies
    // the layer again, for every request: a cost no server pays.
    let bare = Router::new()
        .route("/payments", axum::routing::post(handler))
        .with_state(());
    let layered = Router::new()
        .route("/payments", post(handler))
        .layer(IdempotencyLayer::new(roomy_store()))
        .with_state(());
    let counter = AtomicU64::new(0);

    let mut group = c.benchmark_group("layer");
    group
        .measurement_time(Duration::from_secs(3))
        .sample_size(50);
    group.bench_function("bare service", |b| {
        b.to_async(&runtime)
            .iter(|| call(&bare, request(None), StatusCode::CREATED))
    });
    group.bench_function("layer, new key", |b| {
        b.to_async(&runtime).iter(|| {
            let key = format!("key-{}", counter.fetch_add(1, Ordering::Relaxed));
            call(&layered, request(Some(key)), StatusCode::CREATED)
        })
    });
    runtime.block_on(call(
        &layered,
        request(Some("replayed".into())),
        StatusCode::CREATED,
    ));
    group.bench_function("layer, replay", |b| {
        b.to_async(&runtime).iter(|| {
            call(
                &layered,
                request(Some("replayed".into())),
                StatusCode::CREATED,
            )
        })
    });
    group.bench_function("layer, no key (pass-through)", |b| {
        b.to_async(&runtime)
            .iter(|| call(&layered, request(None), StatusCode::CREATED))
    });
    group.finish();

    // Time from the original's handler finishing to a waiting duplicate's answer.
    let release = Arc::new(Notify::new());
    let waiting = Router::new()
        .route(
            "/payments",
            post(|State(release): State<Arc<Notify>>| async move {
                release.notified().await;
                "done"
            }),
        )
        .with_state(release.clone())
        .layer(IdempotencyLayer::new(MemoryStore::new()));
    let mut group = c.benchmark_group("wait-and-replay");
    group
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    group.bench_function("duplicate answered after original finishes", |b| {
        b.to_async(&runtime).iter_custom(|iterations| {
            let (waiting, release) = (waiting.clone(), release.clone());
            let counter = &counter;
            async move {
                let mut total = Duration::ZERO;
                for _ in 0..iterations {
                    let key = format!("wait-{}", counter.fetch_add(1, Ordering::Relaxed));
                    let owner = tokio::spawn({
                        let (app, key) = (waiting.clone(), key.clone());
                        async move { call(&app, request(Some(key)), StatusCode::OK).await }
                    });
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    let duplicate = tokio::spawn({
                        let (app, key) = (waiting.clone(), key.clone());
                        async move {
                            call(&app, request(Some(key)), StatusCode::OK).await;
                            Instant::now()
                        }
                    });
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    let finished = Instant::now();
                    release.notify_one();
                    let answered = duplicate.await.unwrap();
                    owner.await.unwrap();
                    total += answered.saturating_duration_since(finished);
                }
                total
            }
        })
    });
    group.finish();
}

criterion_group!(benches, bench_layer);
criterion_main!(benches);
