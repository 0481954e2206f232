//! Which requests the layer protects, and how it reads and scopes keys.

mod common;

use axum::{
    body::Body,
    http::{Request, StatusCode},
};
use common::{app, post_req, send, Runs};
use tower_idempotency::{store::MemoryStore, IdempotencyLayer};

#[tokio::test]
async fn missing_key_passes_through_unprotected_by_default() {
    let runs = Runs::default();
    let app = app(IdempotencyLayer::new(MemoryStore::new()), runs.clone());
    let a = send(&app, post_req("/pay", None, "{}")).await;
    let b = send(&app, post_req("/pay", None, "{}")).await;
    assert_eq!(
        (a.status, b.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    // Requests without a key are never grouped under a shared key: both ran.
    assert_eq!(runs.count(), 2);
    assert_ne!(a.body, b.body);
}

#[tokio::test]
async fn missing_key_is_400_where_required_and_nothing_runs() {
    let runs = Runs::default();
    let app = app(
        IdempotencyLayer::new(MemoryStore::new()).require_key(),
        runs.clone(),
    );
    let answer = send(&app, post_req("/pay", None, "{}")).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(answer.problem_type(), "urn:tower-idempotency:missing-key");
    assert_eq!(answer.json()["status"], 400);
    assert_eq!(runs.count(), 0);
}

#[tokio::test]
async fn malformed_keys_are_400_and_nothing_runs() {
    let runs = Runs::default();
    let app = app(IdempotencyLayer::new(MemoryStore::new()), runs.clone());
    let long = "k".repeat(256);
    let cases: Vec<Vec<&[u8]>> = vec![
        vec![b""],
        vec![long.as_bytes()],
        vec![b"has space"],
        vec![b"tab\there"],
        vec!["caf\u{e9}".as_bytes()],
        vec![b"one", b"two"],
        vec![b"\"unterminated"],
    ];
    for values in cases {
        let mut builder = Request::post("/pay");
        for v in &values {
            builder = builder.header(
                "idempotency-key",
                axum::http::HeaderValue::from_bytes(v).unwrap(),
            );
        }
        let answer = send(&app, builder.body(Body::from("{}")).unwrap()).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{values:?}");
        assert_eq!(answer.problem_type(), "urn:tower-idempotency:invalid-key");
    }
    assert_eq!(runs.count(), 0);
}

#[tokio::test]
async fn quoted_and_bare_forms_are_the_same_key() {
    let runs = Runs::default();
    let app = app(
        IdempotencyLayer::new(MemoryStore::new()).replay_set_cookie(true),
        runs.clone(),
    );
    let a = send(&app, post_req("/pay", Some("abc"), "{}")).await;
    let b = send(&app, post_req("/pay", Some("\"abc\""), "{}")).await;
    assert_eq!(a.observable(), b.observable());
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn safe_methods_and_uncovered_methods_pass_through() {
    let runs = Runs::default();
    let router = axum::Router::new()
        .route(
            "/thing",
            axum::routing::get({
                let runs = runs.clone();
                move || async move {
                    runs.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    "got"
                }
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).require_key());
    for _ in 0..3 {
        let request = Request::get("/thing")
            .header("idempotency-key", "k")
            .body(Body::empty())
            .unwrap();
        assert_eq!(send(&router, request).await.status, StatusCode::OK);
    }
    // Even with require_key, GET needs no key.
    let answer = send(&router, Request::get("/thing").body(Body::empty()).unwrap()).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(runs.count(), 4);
}

#[tokio::test]
async fn custom_header_name_and_methods() {
    let runs = Runs::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .header_name(axum::http::HeaderName::from_static("x-request-key"))
        .methods([axum::http::Method::POST]);
    let app = app(layer, runs.clone());
    for _ in 0..2 {
        let request = Request::post("/pay")
            .header("authorization", "Bearer alice")
            .header("x-request-key", "k1")
            .body(Body::from("{}"))
            .unwrap();
        assert_eq!(send(&app, request).await.status, StatusCode::CREATED);
    }
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn same_key_from_two_callers_is_two_operations() {
    let runs = Runs::default();
    let app = app(IdempotencyLayer::new(MemoryStore::new()), runs.clone());
    let as_caller = |who: &str| {
        Request::post("/pay")
            .header("authorization", format!("Bearer {who}"))
            .header("idempotency-key", "shared-key")
            .body(Body::from("{}"))
            .unwrap()
    };
    let alice = send(&app, as_caller("alice")).await;
    let bob = send(&app, as_caller("bob")).await;
    let alice_again = send(&app, as_caller("alice")).await;
    assert_eq!(runs.count(), 2, "bob must not get alice's response");
    assert_ne!(alice.body, bob.body);
    assert_eq!(alice.body, alice_again.body);
}

/// With the default scope, a keyed request without `Authorization` names no caller: it is
/// refused (400 missing-identity) instead of being filed in one scope shared by every
/// anonymous caller, where one could replay another's response or probe its keys (422).
#[tokio::test]
async fn without_identity_a_keyed_request_is_refused_not_pooled_with_other_callers() {
    let runs = Runs::default();
    let app = app(IdempotencyLayer::new(MemoryStore::new()), runs.clone());
    let anonymous = |body: &str| {
        Request::post("/pay")
            .header("idempotency-key", "k")
            .body(Body::from(body.to_owned()))
            .unwrap()
    };
    let first = send(&app, anonymous("{}")).await;
    assert_eq!(first.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        first.problem_type(),
        "urn:tower-idempotency:missing-identity"
    );
    let other = send(&app, anonymous(r#"{"other":1}"#)).await;
    assert_eq!(
        other.problem_type(),
        "urn:tower-idempotency:missing-identity"
    );
    assert_eq!(runs.count(), 0, "nothing ran, nothing was recorded");
    // Without a key the request is not protected at all, identity or not.
    let unkeyed = Request::post("/pay").body(Body::from("{}")).unwrap();
    assert_eq!(send(&app, unkeyed).await.status, StatusCode::CREATED);
    assert_eq!(runs.count(), 1);
}

/// The shared anonymous scope is an explicit opt-in: then anonymous callers share keys.
#[tokio::test]
async fn the_shared_anonymous_scope_is_an_opt_in() {
    let runs = Runs::default();
    let layer = IdempotencyLayer::new(MemoryStore::new()).shared_anonymous_scope();
    let app = app(layer, runs.clone());
    for _ in 0..2 {
        let anonymous = Request::post("/pay")
            .header("idempotency-key", "k")
            .body(Body::from("{}"))
            .unwrap();
        assert_eq!(send(&app, anonymous).await.status, StatusCode::CREATED);
    }
    assert_eq!(
        runs.count(),
        1,
        "the second was a replay in the shared scope"
    );
}

#[tokio::test]
async fn custom_scope_function_namespaces_keys() {
    let runs = Runs::default();
    let layer = IdempotencyLayer::new(MemoryStore::new()).scope_with(|parts| {
        parts
            .headers
            .get("x-tenant")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    });
    let app = app(layer, runs.clone());
    let as_tenant = |tenant: &str| {
        Request::post("/pay")
            .header("x-tenant", tenant)
            .header("idempotency-key", "k")
            .body(Body::from("{}"))
            .unwrap()
    };
    send(&app, as_tenant("t1")).await;
    send(&app, as_tenant("t2")).await;
    send(&app, as_tenant("t1")).await;
    assert_eq!(runs.count(), 2);
}

#[tokio::test]
async fn kill_switch_turns_the_layer_off() {
    let runs = Runs::default();
    let app = app(
        IdempotencyLayer::new(MemoryStore::new())
            .enabled(false)
            .require_key(),
        runs.clone(),
    );
    for _ in 0..2 {
        assert_eq!(
            send(&app, post_req("/pay", Some("k"), "{}")).await.status,
            StatusCode::CREATED
        );
    }
    assert_eq!(
        send(&app, post_req("/pay", None, "{}")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(runs.count(), 3);
}

/// The handler finds its claim's status in the request extensions (to check before an
/// irreversible step that it still owns the key).
#[tokio::test]
async fn the_handler_sees_its_claim_status() {
    use tower_idempotency::engine::ClaimStatus;
    let app: axum::Router = axum::Router::new()
        .route(
            "/status",
            axum::routing::post(|status: Option<axum::Extension<ClaimStatus>>| async move {
                match status {
                    Some(axum::Extension(status)) => format!("lost={}", status.is_lost()),
                    None => "no status".to_owned(),
                }
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()));
    let answer = send(&app, post_req("/status", Some("k"), "{}")).await;
    assert_eq!(answer.body, "lost=false");
}
