//! Duplicates that arrive together: many tasks released at once by a barrier against the real
//! layer and store, counting how often the handler really ran.

mod common;

use std::{collections::HashMap, sync::Arc, time::Duration};

use axum::{
    body::Body,
    http::{Request, StatusCode},
};
use common::{app, layer_with, post_req, send, Answer, Runs};
use tokio::sync::Barrier;
use tower_idempotency::{store::MemoryStore, IdempotencyLayer, InProgressPolicy};

fn slow_post(key: &str, delay_ms: u64) -> Request<Body> {
    Request::post("/pay")
        .header("authorization", "Bearer alice")
        .header("idempotency-key", key)
        .header("x-delay-ms", delay_ms.to_string())
        .body(Body::from(r#"{"amount":100}"#))
        .unwrap()
}

/// Sends `copies` of each key at once; returns every answer grouped by key.
async fn storm(
    app: axum::Router,
    keys: usize,
    copies: usize,
    delay_ms: u64,
) -> HashMap<String, Vec<Answer>> {
    let barrier = Arc::new(Barrier::new(keys * copies));
    let mut tasks = Vec::new();
    for i in 0..keys * copies {
        let (app, barrier) = (app.clone(), barrier.clone());
        let key = format!("key-{}", i % keys);
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let answer = send(&app, slow_post(&key, delay_ms)).await;
            (key, answer)
        }));
    }
    let mut by_key: HashMap<String, Vec<Answer>> = HashMap::new();
    for task in tasks {
        let (key, answer) = task.await.unwrap();
        by_key.entry(key).or_default().push(answer);
    }
    by_key
}

fn assert_identical(answers: &[Answer]) {
    let first = answers[0].observable();
    assert_eq!(first.0, StatusCode::CREATED, "{:?}", answers[0]);
    for other in &answers[1..] {
        assert_eq!(
            other.observable(),
            first,
            "a duplicate saw a different response"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_concurrent_copies_run_once_and_get_identical_responses() {
    let runs = Runs::default();
    let app = app(
        IdempotencyLayer::new(MemoryStore::new()).replay_set_cookie(true),
        runs.clone(),
    );
    let answers = storm(app, 1, 200, 50).await;
    assert_eq!(runs.count(), 1, "the handler must run exactly once");
    assert_identical(&answers["key-0"]);
    assert_eq!(answers["key-0"].len(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_keys_times_twenty_copies_run_fifty_times() {
    let runs = Runs::default();
    let app = app(
        IdempotencyLayer::new(MemoryStore::new()).replay_set_cookie(true),
        runs.clone(),
    );
    let answers = storm(app, 50, 20, 20).await;
    assert_eq!(runs.count(), 50);
    assert_eq!(answers.len(), 50);
    let mut run_numbers = std::collections::HashSet::new();
    for copies in answers.values() {
        assert_eq!(copies.len(), 20);
        assert_identical(copies);
        assert!(
            run_numbers.insert(copies[0].headers["x-run"].clone()),
            "two keys shared a run"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reject_policy_answers_409_with_retry_after_while_running() {
    let runs = Runs::default();
    let layer = layer_with(MemoryStore::new(), |e| {
        e.in_progress(InProgressPolicy::Reject)
            .retry_after(Duration::from_millis(1500))
    });
    let app = app(layer, runs.clone());
    let answers = storm(app.clone(), 1, 30, 300).await;
    let answers = &answers["key-0"];
    let created = answers
        .iter()
        .filter(|a| a.status == StatusCode::CREATED)
        .count();
    let conflicts: Vec<_> = answers
        .iter()
        .filter(|a| a.status == StatusCode::CONFLICT)
        .collect();
    assert_eq!(runs.count(), 1);
    assert_eq!(created, 1);
    assert_eq!(conflicts.len(), 29);
    for conflict in conflicts {
        assert_eq!(conflict.problem_type(), "urn:tower-idempotency:in-progress");
        assert_eq!(conflict.headers["retry-after"], "2", "1.5 s rounds up");
    }
    // Once finished, a retry gets the stored response.
    let after = send(&app, slow_post("key-0", 300)).await;
    assert_eq!(after.status, StatusCode::CREATED);
    assert_eq!(runs.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiting_past_the_timeout_gives_409_then_replay() {
    let runs = Runs::default();
    let layer = layer_with(MemoryStore::new(), |e| {
        e.in_progress(InProgressPolicy::Wait {
            timeout: Duration::from_millis(100),
        })
    });
    let app = app(layer, runs.clone());
    let owner = tokio::spawn({
        let app = app.clone();
        async move { send(&app, slow_post("k", 800)).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let impatient = send(&app, slow_post("k", 800)).await;
    assert_eq!(impatient.status, StatusCode::CONFLICT);
    assert!(impatient.headers.contains_key("retry-after"));
    let original = owner.await.unwrap();
    let later = send(&app, slow_post("k", 800)).await;
    assert_eq!(later.observable().2, original.observable().2);
    assert_eq!(runs.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_slower_than_its_lease_still_runs_once() {
    let runs = Runs::default();
    let layer = layer_with(MemoryStore::new(), |e| {
        e.lease(Duration::from_millis(200))
            .store_timeout(Duration::from_millis(35))
    })
    .replay_set_cookie(true);
    let app = app(layer, runs.clone());
    // The handler takes 5 leases; duplicates keep arriving during all of it.
    let owner = tokio::spawn({
        let app = app.clone();
        async move { send(&app, slow_post("k", 1000)).await }
    });
    let mut duplicates = Vec::new();
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(90)).await;
        let app = app.clone();
        duplicates.push(tokio::spawn(async move {
            send(&app, slow_post("k", 1000)).await
        }));
    }
    let original = owner.await.unwrap();
    for duplicate in duplicates {
        assert_eq!(duplicate.await.unwrap().observable(), original.observable());
    }
    assert_eq!(
        runs.count(),
        1,
        "the lease must be renewed while the handler runs"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_hangs_up_does_not_cause_a_second_run() {
    let runs = Runs::default();
    let app = app(
        IdempotencyLayer::new(MemoryStore::new()).replay_set_cookie(true),
        runs.clone(),
    );
    // The client gives up after 100 ms; the handler needs 400 ms.
    let cut =
        tokio::time::timeout(Duration::from_millis(100), send(&app, slow_post("k", 400))).await;
    assert!(cut.is_err(), "the first request should have been cancelled");
    // The retry waits for the detached original and replays it.
    let retry = send(&app, slow_post("k", 400)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.headers["x-run"], "1");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(runs.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_detach_a_hang_up_releases_the_key_instead_of_leaving_it_claimed() {
    let runs = Runs::default();
    let layer = layer_with(MemoryStore::new(), |e| {
        e.in_progress(InProgressPolicy::Reject)
    })
    .detach(false);
    let app = app(layer, runs.clone());
    let cut =
        tokio::time::timeout(Duration::from_millis(100), send(&app, slow_post("k", 400))).await;
    assert!(cut.is_err());
    // The release runs in the background right after the drop.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let retry = send(&app, slow_post("k", 10)).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "no stale claim may be left: {retry:?}"
    );
    assert_eq!(
        runs.count(),
        2,
        "the cut handler was dropped, the retry ran it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_released_key_is_never_run_by_two_duplicates_at_once() {
    // Every run fails with 503 and releases the key; the waiting duplicates take it over one
    // at a time. Count how many runs overlap: never more than one.
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    let in_flight = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (in_flight, most, runs) = (in_flight.clone(), most.clone(), runs.clone());
        move || async move {
            runs.fetch_add(1, SeqCst);
            let now = in_flight.fetch_add(1, SeqCst) + 1;
            most.fetch_max(now, SeqCst);
            tokio::time::sleep(Duration::from_millis(20)).await;
            in_flight.fetch_sub(1, SeqCst);
            StatusCode::SERVICE_UNAVAILABLE
        }
    };
    let app = axum::Router::new()
        .route("/flaky", axum::routing::post(handler))
        .layer(IdempotencyLayer::new(MemoryStore::new()));
    let barrier = Arc::new(Barrier::new(20));
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (app, barrier) = (app.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            send(&app, post_req("/flaky", Some("k"), "")).await.status
        }));
    }
    let mut unavailable = 0;
    for task in tasks {
        if task.await.unwrap() == StatusCode::SERVICE_UNAVAILABLE {
            unavailable += 1;
        }
    }
    assert_eq!(most.load(SeqCst), 1, "two duplicates ran at the same time");
    // A 503 is never stored, so every copy ended up running it itself, one after another.
    assert_eq!(runs.load(SeqCst), 20);
    assert_eq!(unavailable, 20);
}
