//! What a duplicate of a finished request gets back.

mod common;

use axum::{
    body::Body,
    http::{header, Request, StatusCode},
};
use common::{app, layer_with, post_req, send, Runs};
use tower_http::compression::CompressionLayer;
use tower_idempotency::{store::MemoryStore, IdempotencyLayer};

#[tokio::test]
async fn duplicate_gets_the_identical_response_and_nothing_runs_again() {
    let runs = Runs::default();
    let app = app(
        IdempotencyLayer::new(MemoryStore::new()).replay_set_cookie(true),
        runs.clone(),
    );
    let first = send(&app, post_req("/pay", Some("k1"), r#"{"amount":5}"#)).await;
    let second = send(&app, post_req("/pay", Some("k1"), r#"{"amount":5}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.observable(), second.observable());
    assert_eq!(runs.count(), 1);
    // Multi-valued headers are kept as separate values, comma values are not split.
    let cookies: Vec<_> = second.headers.get_all(header::SET_COOKIE).iter().collect();
    assert_eq!(cookies, ["a=1", "b=2"]);
    let multi: Vec<_> = second.headers.get_all("x-multi").iter().collect();
    assert_eq!(multi, ["one", "two"]);
    assert_eq!(
        second.headers[header::LINK],
        "</x>; rel=next, </y>; rel=prev"
    );
    assert_eq!(second.headers["x-bin"].as_bytes(), b"\xfe\xff");
    assert!(second.headers.get("idempotent-replayed").is_none());
}

#[tokio::test]
async fn set_cookie_is_not_replayed_by_default() {
    let runs = Runs::default();
    let app = app(IdempotencyLayer::new(MemoryStore::new()), runs.clone());
    let first = send(&app, post_req("/pay", Some("k1"), "{}")).await;
    let second = send(&app, post_req("/pay", Some("k1"), "{}")).await;
    assert_eq!(first.headers.get_all(header::SET_COOKIE).iter().count(), 2);
    assert_eq!(second.headers.get_all(header::SET_COOKIE).iter().count(), 0);
    assert_eq!(first.body, second.body);
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn replayed_marker_is_opt_in() {
    let runs = Runs::default();
    let app = app(
        IdempotencyLayer::new(MemoryStore::new()).mark_replayed(true),
        runs.clone(),
    );
    let first = send(&app, post_req("/pay", Some("k1"), "{}")).await;
    let second = send(&app, post_req("/pay", Some("k1"), "{}")).await;
    assert!(first.headers.get("idempotent-replayed").is_none());
    assert_eq!(second.headers["idempotent-replayed"], "true");
}

#[tokio::test]
async fn binary_bodies_replay_byte_for_byte() {
    let runs = Runs::default();
    let app = app(IdempotencyLayer::new(MemoryStore::new()), runs.clone());
    let first = send(&app, post_req("/big/70000", Some("k"), "")).await;
    let second = send(&app, post_req("/big/70000", Some("k"), "")).await;
    assert_eq!(first.body.len(), 70000);
    assert_eq!(first.observable(), second.observable());
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn same_key_different_request_is_422_and_nothing_runs() {
    let runs = Runs::default();
    let app = app(IdempotencyLayer::new(MemoryStore::new()), runs.clone());
    send(&app, post_req("/pay?x=1", Some("k"), r#"{"amount":5}"#)).await;
    for (uri, body) in [
        ("/pay?x=1", r#"{"amount":6}"#),
        ("/pay?x=1", r#"{"amount": 5}"#),
        ("/pay?x=2", r#"{"amount":5}"#),
        ("/pay", r#"{"amount":5}"#),
        ("/status/201?x=1", r#"{"amount":5}"#),
    ] {
        let answer = send(&app, post_req(uri, Some("k"), body)).await;
        assert_eq!(
            answer.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{uri} {body}"
        );
        assert_eq!(answer.problem_type(), "urn:tower-idempotency:key-reused");
    }
    let patch = Request::patch("/pay?x=1")
        .header("authorization", "Bearer alice")
        .header("idempotency-key", "k")
        .body(Body::from(r#"{"amount":5}"#))
        .unwrap();
    assert_eq!(
        send(&app, patch).await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(runs.count(), 1);
}

/// A request body in `chunks` frames, as a client streaming its upload sends it.
fn chunked(key: &str, chunks: &[&'static str]) -> Request<Body> {
    let frames = chunks.iter().map(|chunk| {
        Ok::<_, std::convert::Infallible>(bytes::Bytes::from_static(chunk.as_bytes()))
    });
    Request::post("/pay")
        .header("authorization", "Bearer alice")
        .header("idempotency-key", key)
        .body(Body::from_stream(futures_util::stream::iter(
            frames.collect::<Vec<_>>(),
        )))
        .unwrap()
}

#[tokio::test]
async fn the_same_bytes_in_other_frames_are_the_same_request() {
    let runs = Runs::default();
    let app = app(IdempotencyLayer::new(MemoryStore::new()), runs.clone());
    let first = send(&app, chunked("k", &[r#"{"amount":5}"#])).await;
    assert_eq!(first.status, StatusCode::CREATED);
    // The handler saw the whole body, however it arrived (it echoes the length).
    assert_eq!(first.body, r#"{"run":1,"echo":12}"#);
    for frames in [
        &[r#"{"amo"#, r#"unt":5}"#][..],
        &[r#"{"#, r#""amount""#, r#":5"#, r#"}"#][..],
        &[r#"{"amount":5}"#, ""][..],
    ] {
        let again = send(&app, chunked("k", frames)).await;
        // A replay: the first run's answer (`run` 1), not a second run.
        assert_eq!(
            (again.status, &again.body),
            (first.status, &first.body),
            "{frames:?}"
        );
    }
    // Other bytes in the same frames are another request.
    let other = send(&app, chunked("k", &[r#"{"amo"#, r#"unt":6}"#])).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    // A body gathered from frames reaches the handler whole.
    let fresh = send(&app, chunked("k2", &[r#"{"amo"#, r#"unt":"#, "77}"])).await;
    assert_eq!(fresh.body, r#"{"run":2,"echo":13}"#);
    assert_eq!(runs.count(), 2);
}

#[tokio::test]
async fn fingerprinted_header_counts() {
    let runs = Runs::default();
    let layer = IdempotencyLayer::new(MemoryStore::new()).fingerprint_header(header::CONTENT_TYPE);
    let app = app(layer, runs.clone());
    let with_type = |ct: &str| {
        Request::post("/pay")
            .header("authorization", "Bearer alice")
            .header("idempotency-key", "k")
            .header("content-type", ct)
            .body(Body::from("{}"))
            .unwrap()
    };
    send(&app, with_type("application/json")).await;
    assert_eq!(
        send(&app, with_type("application/json")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        send(&app, with_type("text/plain")).await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn completed_key_runs_again_after_retention() {
    let runs = Runs::default();
    let layer = layer_with(MemoryStore::new(), |e| {
        e.retention(std::time::Duration::from_millis(300))
    });
    let app = app(layer, runs.clone());
    send(&app, post_req("/pay", Some("k"), "{}")).await;
    send(&app, post_req("/pay", Some("k"), "{}")).await;
    assert_eq!(runs.count(), 1);
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    send(&app, post_req("/pay", Some("k"), "{}")).await;
    assert_eq!(
        runs.count(),
        2,
        "after the retention the key is a new request"
    );
}

/// A route that counts its runs and answers 4 KiB of compressible text, with compression
/// outside the idempotency layer (`outside`) or inside it.
fn compressed_app(outside: bool, runs: Runs) -> axum::Router {
    let text = || async move { "replay fidelity ".repeat(256) };
    let handler = move || {
        runs.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        text()
    };
    let routes = axum::Router::new().route("/report", axum::routing::post(handler));
    let layer = IdempotencyLayer::new(MemoryStore::new());
    if outside {
        routes.layer(layer).layer(CompressionLayer::new())
    } else {
        routes.layer(CompressionLayer::new()).layer(layer)
    }
}

/// A keyed `POST /report`, asking for gzip or not.
fn report(gzip: bool) -> Request<Body> {
    let mut request = Request::post("/report")
        .header("authorization", "Bearer alice")
        .header("idempotency-key", "report-1");
    if gzip {
        request = request.header(header::ACCEPT_ENCODING, "gzip");
    }
    request.body(Body::empty()).unwrap()
}

/// The documented place of compression: outside the layer. The stored response is the
/// handler's own, so each duplicate is encoded for its own `Accept-Encoding`; and
/// `Accept-Encoding` is not part of the fingerprint, so a retry asking for another encoding
/// is the same request (replayed, not 422).
#[tokio::test]
async fn compression_outside_the_layer_encodes_each_replay_for_its_own_client() {
    let runs = Runs::default();
    let app = compressed_app(true, runs.clone());
    let gzipped = send(&app, report(true)).await;
    let plain = send(&app, report(false)).await;
    assert_eq!(runs.count(), 1, "the retry was replayed");
    assert_eq!(gzipped.headers[header::CONTENT_ENCODING], "gzip");
    assert!(plain.headers.get(header::CONTENT_ENCODING).is_none());
    assert_eq!(plain.body, "replay fidelity ".repeat(256));
}

/// Why not inside: the stored response carries the first client's encoding, and a duplicate
/// gets those bytes whatever it accepts (here gzip for a client that asked for none).
#[tokio::test]
async fn compression_inside_the_layer_replays_the_first_clients_encoding() {
    let runs = Runs::default();
    let app = compressed_app(false, runs.clone());
    let gzipped = send(&app, report(true)).await;
    let plain = send(&app, report(false)).await;
    assert_eq!(runs.count(), 1, "the retry was replayed");
    assert_eq!(plain.headers[header::CONTENT_ENCODING], "gzip");
    assert_eq!(plain.body, gzipped.body);
}
