//! A small axum app behind the real layer, with handlers that count how often they ran.
#![allow(dead_code)]

pub mod faulty;
pub mod proxy;

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use axum::{
    body::Body,
    extract::{Path, State},
    http::{header, HeaderMap, HeaderValue, Request, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
    Router,
};
use bytes::Bytes;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{
    engine::EngineBuilder, store::Store, DoNotStore, Engine, IdempotencyLayer,
};

/// How many times each handler really ran.
#[derive(Clone, Default)]
pub struct Runs(pub Arc<AtomicUsize>);

impl Runs {
    pub fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    fn bump(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
}

/// A finished response, body read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    /// Status, headers (in order, all values) and body: what a client can observe.
    pub fn observable(&self) -> (StatusCode, Vec<(String, Vec<u8>)>, Bytes) {
        let headers = self
            .headers
            .iter()
            .filter(|(name, _)| *name != header::DATE)
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        (self.status, headers, self.body.clone())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    pub fn problem_type(&self) -> String {
        assert_eq!(
            self.headers[header::CONTENT_TYPE],
            "application/problem+json",
            "{self:?}"
        );
        self.json()["type"].as_str().unwrap().to_owned()
    }
}

/// Routes:
/// - `POST /pay`: counts a run, sleeps `x-delay-ms`, answers 201 with the run number, two
///   `Set-Cookie`s, a comma-containing `Link` and a binary `x-bin` header.
/// - `POST /status/{code}`: counts a run, answers that status.
/// - `POST /no-store`: counts a run, answers 422 marked `DoNotStore`.
/// - `POST /panic`: counts a run, panics.
/// - `POST /big/{bytes}`: counts a run, answers a body of that many bytes.
pub fn app(layer: IdempotencyLayer, runs: Runs) -> Router {
    Router::new()
        .route("/pay", post(pay))
        .route("/status/{code}", post(status))
        .route("/no-store", post(no_store))
        .route("/panic", post(panic_handler))
        .route("/big/{bytes}", post(big))
        .with_state(runs)
        .layer(layer)
}

async fn pay(State(runs): State<Runs>, headers: HeaderMap, body: Bytes) -> Response {
    let run = runs.bump();
    if let Some(ms) = headers
        .get("x-delay-ms")
        .and_then(|v| v.to_str().ok()?.parse().ok())
    {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let mut response = (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        format!(r#"{{"run":{run},"echo":{}}}"#, body.len()),
    )
        .into_response();
    let h = response.headers_mut();
    h.append(header::SET_COOKIE, HeaderValue::from_static("a=1"));
    h.append(header::SET_COOKIE, HeaderValue::from_static("b=2"));
    h.append(
        header::LINK,
        HeaderValue::from_static("</x>; rel=next, </y>; rel=prev"),
    );
    h.append("x-bin", HeaderValue::from_bytes(b"\xfe\xff").unwrap());
    h.append("x-multi", HeaderValue::from_static("one"));
    h.append("x-multi", HeaderValue::from_static("two"));
    h.append("x-run", HeaderValue::from(run));
    response
}

async fn status(State(runs): State<Runs>, Path(code): Path<u16>) -> Response {
    let run = runs.bump();
    (StatusCode::from_u16(code).unwrap(), format!("run {run}")).into_response()
}

async fn no_store(State(runs): State<Runs>) -> Response {
    runs.bump();
    let mut response = (StatusCode::UNPROCESSABLE_ENTITY, "fix your input").into_response();
    response.extensions_mut().insert(DoNotStore);
    response
}

async fn panic_handler(State(runs): State<Runs>) -> Response {
    runs.bump();
    panic!("handler exploded");
}

async fn big(State(runs): State<Runs>, Path(bytes): Path<usize>) -> Response {
    let run = runs.bump();
    let body: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8 ^ run as u8).collect();
    (StatusCode::OK, body).into_response()
}

/// A layer over an engine whose timings `configure` sets (checked: the test fails on timings
/// the builder refuses).
pub fn layer_with<S: Store>(
    store: S,
    configure: impl FnOnce(EngineBuilder) -> EngineBuilder,
) -> IdempotencyLayer {
    let engine = configure(Engine::builder(store))
        .build()
        .unwrap_or_else(|e| panic!("test timings refused: {e}"));
    IdempotencyLayer::from_engine(engine)
}

/// A POST to `uri` with `key` (if any), an `Authorization` of `caller` and `body`.
pub fn post_req(uri: &str, key: Option<&str>, body: &str) -> Request<Body> {
    let mut builder = Request::post(uri).header("authorization", "Bearer alice");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder.body(Body::from(body.to_owned())).unwrap()
}

pub async fn send(app: &Router, request: Request<Body>) -> Answer {
    let response = app.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}
