//! Outcomes that are not stored, bodies over the limits, panics and handler errors.

mod common;

use std::convert::Infallible;

use axum::{
    body::Body,
    http::{Request, StatusCode},
};
use bytes::Bytes;
use common::{app, post_req, send, Runs};
use tower::ServiceExt;
use tower_idempotency::{store::MemoryStore, IdempotencyLayer};

#[tokio::test]
async fn server_errors_and_retryable_statuses_release_the_key() {
    for code in [500, 502, 503, 408, 409, 425, 429] {
        let runs = Runs::default();
        let app = app(IdempotencyLayer::new(MemoryStore::new()), runs.clone());
        let uri = format!("/status/{code}");
        let first = send(&app, post_req(&uri, Some("k"), "")).await;
        let second = send(&app, post_req(&uri, Some("k"), "")).await;
        assert_eq!(first.status.as_u16(), code);
        assert_eq!(
            (second.status.as_u16(), &second.body[..]),
            (code, &b"run 2"[..])
        );
        assert_eq!(
            runs.count(),
            2,
            "{code} must release the key so a retry runs"
        );
    }
}

#[tokio::test]
async fn other_statuses_are_final() {
    for code in [200, 201, 202, 204, 400, 404, 422] {
        let runs = Runs::default();
        let app = app(IdempotencyLayer::new(MemoryStore::new()), runs.clone());
        let uri = format!("/status/{code}");
        let first = send(&app, post_req(&uri, Some("k"), "")).await;
        let second = send(&app, post_req(&uri, Some("k"), "")).await;
        assert_eq!(first.observable(), second.observable(), "{code}");
        assert_eq!(runs.count(), 1, "{code} is final");
    }
}

#[tokio::test]
async fn status_policy_is_configurable() {
    let runs = Runs::default();
    let layer = IdempotencyLayer::new(MemoryStore::new()).store_status(|s| s.is_success());
    let app = app(layer, runs.clone());
    send(&app, post_req("/status/404", Some("k"), "")).await;
    send(&app, post_req("/status/404", Some("k"), "")).await;
    assert_eq!(runs.count(), 2);
    send(&app, post_req("/status/503", Some("j"), "")).await;
    assert_eq!(runs.count(), 3);
}

#[tokio::test]
async fn a_handler_can_opt_a_response_out_of_storage() {
    let runs = Runs::default();
    let app = app(IdempotencyLayer::new(MemoryStore::new()), runs.clone());
    for _ in 0..2 {
        let answer = send(&app, post_req("/no-store", Some("k"), "")).await;
        assert_eq!(answer.status, StatusCode::UNPROCESSABLE_ENTITY);
    }
    assert_eq!(runs.count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_answers_500_and_releases_the_key() {
    let runs = Runs::default();
    let app = app(IdempotencyLayer::new(MemoryStore::new()), runs.clone());
    for expected_runs in 1..=2 {
        let answer = send(&app, post_req("/panic", Some("k"), "")).await;
        assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            answer.problem_type(),
            "urn:tower-idempotency:handler-panicked"
        );
        assert_eq!(
            runs.count(),
            expected_runs,
            "the retry must run again, not wait or get 409"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_without_detach_also_releases() {
    let runs = Runs::default();
    let app = app(
        IdempotencyLayer::new(MemoryStore::new()).detach(false),
        runs.clone(),
    );
    for expected_runs in 1..=2 {
        let answer = send(&app, post_req("/panic", Some("k"), "")).await;
        assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(runs.count(), expected_runs);
    }
}

#[tokio::test]
async fn an_inner_service_error_is_passed_on_and_releases_the_key() {
    let calls = Runs::default();
    let inner = tower::service_fn({
        let calls = calls.clone();
        move |_request: Request<Body>| {
            let calls = calls.clone();
            async move {
                calls.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Err::<http::Response<Body>, _>(std::io::Error::other("downstream broke"))
            }
        }
    });
    let service = tower::Layer::layer(&IdempotencyLayer::new(MemoryStore::new()), inner);
    for expected in 1..=2 {
        let error = service
            .clone()
            .oneshot(post_req("/x", Some("k"), ""))
            .await
            .unwrap_err();
        assert_eq!(error.to_string(), "downstream broke");
        assert_eq!(calls.count(), expected);
    }
}

#[tokio::test]
async fn a_body_over_the_limit_is_413_and_nothing_runs() {
    let runs = Runs::default();
    let app = app(
        IdempotencyLayer::new(MemoryStore::new()).max_request_body(1000),
        runs.clone(),
    );
    // Declared too large by Content-Length.
    let answer = send(&app, post_req("/pay", Some("k"), &"x".repeat(1001))).await;
    assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        answer.problem_type(),
        "urn:tower-idempotency:body-too-large"
    );
    // Streamed without a length, found too large while reading.
    let chunks = (0..20).map(|_| Ok::<_, Infallible>(Bytes::from(vec![b'y'; 100])));
    let streamed = Request::post("/pay")
        .header("authorization", "Bearer alice")
        .header("idempotency-key", "k2")
        .body(Body::from_stream(futures_util::stream::iter(chunks)))
        .unwrap();
    assert_eq!(
        send(&app, streamed).await.status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    assert_eq!(runs.count(), 0);
    // At the limit is fine.
    assert_eq!(
        send(&app, post_req("/pay", Some("k3"), &"x".repeat(1000)))
            .await
            .status,
        StatusCode::CREATED
    );
}

#[tokio::test]
async fn a_body_that_breaks_mid_upload_is_400_and_claims_nothing() {
    let runs = Runs::default();
    let app = app(IdempotencyLayer::new(MemoryStore::new()), runs.clone());
    let chunks = vec![
        Ok(Bytes::from_static(b"{\"amo")),
        Err(std::io::Error::other("connection reset")),
    ];
    let broken = Request::post("/pay")
        .header("authorization", "Bearer alice")
        .header("idempotency-key", "k")
        .body(Body::from_stream(futures_util::stream::iter(chunks)))
        .unwrap();
    let answer = send(&app, broken).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        answer.problem_type(),
        "urn:tower-idempotency:body-unreadable"
    );
    assert_eq!(runs.count(), 0);
    // The key was never claimed: the complete upload runs normally.
    let whole = Request::post("/pay")
        .header("authorization", "Bearer alice")
        .header("idempotency-key", "k")
        .body(Body::from("{\"amount\":1}"))
        .unwrap();
    assert_eq!(send(&app, whole).await.status, StatusCode::CREATED);
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn a_response_over_the_storage_limit_is_sent_whole_and_never_run_again() {
    let runs = Runs::default();
    let app = app(
        IdempotencyLayer::new(MemoryStore::new()).max_response_body(1000),
        runs.clone(),
    );
    let first = send(&app, post_req("/big/5000", Some("k"), "")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(
        first.body.len(),
        5000,
        "the first caller gets the whole response"
    );
    for _ in 0..2 {
        let duplicate = send(&app, post_req("/big/5000", Some("k"), "")).await;
        assert_eq!(duplicate.status, StatusCode::CONFLICT);
        assert_eq!(
            duplicate.problem_type(),
            "urn:tower-idempotency:response-not-stored"
        );
        assert!(duplicate.json()["detail"].as_str().unwrap().contains("200"));
        assert!(
            !duplicate.headers.contains_key("retry-after"),
            "retrying cannot help"
        );
    }
    assert_eq!(runs.count(), 1);
    // Responses within the limit on the same layer are stored as usual.
    let small = send(&app, post_req("/big/999", Some("j"), "")).await;
    assert_eq!(
        send(&app, post_req("/big/999", Some("j"), ""))
            .await
            .observable(),
        small.observable()
    );
    assert_eq!(runs.count(), 2);
}

#[tokio::test]
async fn custom_rejection_rendering_replaces_problem_json() {
    let runs = Runs::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .require_key()
        .on_rejection(|rejection| {
            let mut response =
                http::Response::new(Bytes::from(format!("nope: {}", rejection.status())));
            *response.status_mut() = StatusCode::IM_A_TEAPOT;
            response
        });
    let app = app(layer, runs.clone());
    let answer = send(&app, post_req("/pay", None, "")).await;
    assert_eq!(answer.status, StatusCode::IM_A_TEAPOT);
    assert_eq!(&answer.body[..], b"nope: 400 Bad Request");
}
