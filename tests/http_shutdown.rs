//! Graceful shutdown: `Engine::drained` waits until every claim is completed or released.

mod common;

use std::time::Duration;

use axum::{
    body::Body,
    http::{Request, StatusCode},
};
use common::{app, layer_with, send, Runs};
use tower_idempotency::{store::MemoryStore, IdempotencyLayer, InProgressPolicy};

fn slow_post(key: &str, delay_ms: u64) -> Request<Body> {
    Request::post("/pay")
        .header("authorization", "Bearer alice")
        .header("idempotency-key", key)
        .header("x-delay-ms", delay_ms.to_string())
        .body(Body::from("{}"))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drained_waits_for_a_detached_handler_to_record_its_outcome() {
    let runs = Runs::default();
    let layer = layer_with(MemoryStore::new(), |e| {
        e.in_progress(InProgressPolicy::Reject)
    });
    let engine = layer.engine().clone();
    let app = app(layer, runs.clone());
    // Nothing held: drained at once.
    tokio::time::timeout(Duration::from_secs(1), engine.drained())
        .await
        .expect("idle engine");

    // The client hangs up after 50 ms; the detached handler needs 400 ms.
    let cut =
        tokio::time::timeout(Duration::from_millis(50), send(&app, slow_post("k", 400))).await;
    assert!(cut.is_err());
    assert_eq!(
        engine.in_flight(),
        1,
        "the detached handler still holds its claim"
    );

    tokio::time::timeout(Duration::from_secs(5), engine.drained())
        .await
        .expect("drained must resolve once the handler finished");
    assert_eq!(engine.in_flight(), 0);
    assert_eq!(runs.count(), 1);
    // Recorded, not merely finished: a duplicate (which would get 409 while in progress,
    // under this policy) gets the stored 201.
    let duplicate = send(&app, slow_post("k", 400)).await;
    assert_eq!(duplicate.status, StatusCode::CREATED);
    assert_eq!(runs.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_claim_is_no_longer_in_flight() {
    let runs = Runs::default();
    let layer = IdempotencyLayer::new(MemoryStore::new()).detach(false);
    let engine = layer.engine().clone();
    let app = app(layer, runs.clone());
    let cut =
        tokio::time::timeout(Duration::from_millis(50), send(&app, slow_post("k", 400))).await;
    assert!(cut.is_err());
    // The dropped claim releases itself in the background, and counts until it has.
    tokio::time::timeout(Duration::from_secs(5), engine.drained())
        .await
        .expect("a dropped claim must be released and counted out");
    assert_eq!(engine.in_flight(), 0);
}

/// A detached handler that would run for ten minutes is ended at the layer's maximum handler
/// lifetime: its key is released (a retry runs it again) and `drained()` finishes. Outer
/// timeouts no longer reach it once its client left, so without the bound it would hold its
/// key and keep `drained()` pending for the whole ten minutes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detached_handler_is_ended_at_its_maximum_lifetime() {
    let runs = Runs::default();
    let layer = layer_with(MemoryStore::new(), |e| {
        e.in_progress(InProgressPolicy::Reject)
    })
    .detach_limits(16, Duration::from_millis(300));
    let engine = layer.engine().clone();
    let app = app(layer, runs.clone());
    let cut = tokio::time::timeout(
        Duration::from_millis(50),
        send(&app, slow_post("k", 600_000)),
    )
    .await;
    assert!(cut.is_err());
    assert_eq!(engine.in_flight(), 1, "detached, still running");
    tokio::time::timeout(Duration::from_secs(5), engine.drained())
        .await
        .expect("drained must finish once the lifetime ended the handler");
    // Released, not recorded: the retry runs.
    let retry = send(&app, slow_post("k", 0)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(runs.count(), 2);
}

/// With one detached slot, the second client that hangs up does not get its handler detached:
/// it is dropped and its key released at once, so its retry runs instead of meeting a claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_beyond_the_detached_limit_are_dropped_and_their_keys_released() {
    let runs = Runs::default();
    let layer = layer_with(MemoryStore::new(), |e| {
        e.in_progress(InProgressPolicy::Reject)
    })
    .detach_limits(1, Duration::from_secs(60));
    let engine = layer.engine().clone();
    let app = app(layer, runs.clone());
    for key in ["first", "second"] {
        let cut = tokio::time::timeout(
            Duration::from_millis(50),
            send(&app, slow_post(key, 600_000)),
        )
        .await;
        assert!(cut.is_err());
    }
    // The second one's claim is released in the background right after the drop.
    let retry = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let retry = send(&app, slow_post("second", 0)).await;
            if retry.status != StatusCode::CONFLICT {
                return retry;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the second handler was detached over the limit: its key stayed claimed");
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(engine.in_flight(), 1, "only the first is still detached");
    let first = send(&app, slow_post("first", 0)).await;
    assert_eq!(
        first.status,
        StatusCode::CONFLICT,
        "the detached first still runs"
    );
    assert_eq!(runs.count(), 3);
}
