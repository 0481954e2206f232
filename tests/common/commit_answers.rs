//! What the commit-outcome tests share: the transactional mode under test, one keyed
//! request to a router, the check of a retryable 503 answer, and a counter read from the
//! Prometheus rendering.
#![allow(dead_code)]

use std::time::Duration;

use axum::{
    body::{to_bytes, Body},
    http::{header, HeaderMap, Request, StatusCode},
    Router,
};
use bytes::Bytes;
use tower::ServiceExt;
use tower_idempotency::{
    transactional::{Transactional, TransactionalStore},
    Engine,
};

/// The engine's time limit on store calls, set (not left to the default) so that a test can
/// tell an answer caused by the limit from one caused by its fault.
pub const STORE_TIMEOUT: Duration = Duration::from_secs(5);

/// The series a dashboard reads for the `outcome-unknown` answer.
pub const OUTCOME_UNKNOWN: &str =
    "idempotency_requests_total{outcome=\"rejected\",reason=\"outcome_unknown\"}";

/// The transactional mode on `store`, with [`STORE_TIMEOUT`].
pub fn transactional<S: TransactionalStore>(store: &S) -> Transactional<S> {
    let engine = Engine::builder(store.clone())
        .store_timeout(STORE_TIMEOUT)
        .build()
        .expect("valid timings");
    Transactional::with_engine(store.clone(), engine)
}

/// Sends one keyed `POST /`, with `extra` as one more header when given.
pub async fn send(
    app: Router,
    key: String,
    extra: Option<(&'static str, String)>,
) -> (StatusCode, HeaderMap, Bytes) {
    let mut request = Request::post("/").header("idempotency-key", key);
    if let Some((name, value)) = extra {
        request = request.header(name, value);
    }
    let response = app
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    let body = to_bytes(body, usize::MAX).await.unwrap();
    (parts.status, parts.headers, body)
}

/// Asserts the answer is a 503 problem of `problem_type` with a `Retry-After` of at least
/// one second, and returns its `detail`.
#[track_caller]
pub fn assert_retryable_503(
    (status, headers, body): &(StatusCode, HeaderMap, Bytes),
    problem_type: &str,
) -> String {
    assert_eq!(*status, StatusCode::SERVICE_UNAVAILABLE, "{body:?}");
    let retry_after = headers
        .get(header::RETRY_AFTER)
        .expect("a Retry-After header")
        .to_str()
        .unwrap();
    assert!(retry_after.parse::<u64>().unwrap() >= 1, "{retry_after}");
    let problem: serde_json::Value = serde_json::from_slice(body).expect("problem+json");
    assert_eq!(problem["type"], problem_type, "{problem}");
    assert_eq!(problem["status"], 503);
    problem["detail"].as_str().unwrap().to_owned()
}

/// The value of `series` in a Prometheus text rendering; 0 when absent.
pub fn counter(rendered: &str, series: &str) -> u64 {
    rendered
        .lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0)
}
