//! Keys scoped by the caller an authentication layer verified (`Principal`), not by its
//! credential: a retry sent with a refreshed token is replayed, not charged again, while
//! another caller reusing the key, or a forged token, never reaches the first caller's
//! record. Effects are rows in PostgreSQL, one per charge.

#[path = "common/backends.rs"]
mod backends;
#[path = "common/effects_table.rs"]
mod effects_table;
#[path = "common/pg_effects.rs"]
mod pg_effects;

use std::{collections::HashMap, sync::Arc};

use axum::{
    body::Body,
    extract::{Request, State},
    http::StatusCode,
    middleware::{self, Next},
    response::Response,
    routing::post,
    Router,
};
use bytes::Bytes;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{store::PostgresStore, IdempotencyLayer, Principal, StoreKey, Token};

/// Access tokens and the user each was issued to: what a real authentication layer checks
/// with a signature or its identity provider. `alice-2` is `alice-1` refreshed.
fn issued() -> Arc<HashMap<&'static str, &'static str>> {
    Arc::new(HashMap::from([
        ("alice-1", "alice"),
        ("alice-2", "alice"),
        ("bob-1", "bob"),
    ]))
}

/// Verifies the bearer token, refuses an unknown one, and names the caller.
async fn authenticate(
    State(tokens): State<Arc<HashMap<&'static str, &'static str>>>,
    mut request: Request,
    next: Next,
) -> Result<Response, StatusCode> {
    let token = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let user = token
        .and_then(|token| tokens.get(token))
        .ok_or(StatusCode::UNAUTHORIZED)?;
    request.extensions_mut().insert(Principal::new(*user));
    Ok(next.run(request).await)
}

/// `POST /charge`: one effect row for its key, and a charge id of its own.
fn charges(store: &PostgresStore, table: &str) -> Router {
    let (pool, table) = (store.pool().clone(), table.to_owned());
    let charge = move |request: Request| {
        let (pool, table) = (pool.clone(), table.clone());
        async move {
            let key = request.headers()["idempotency-key"]
                .to_str()
                .unwrap()
                .to_owned();
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {table} (k) VALUES ($1)"
            )))
            .bind(key)
            .execute(&pool)
            .await
            .unwrap();
            (
                StatusCode::CREATED,
                format!("ch_{}", Token::random().to_hex()),
            )
        }
    };
    Router::new().route("/charge", post(charge))
}

async fn send(app: &Router, token: &str, key: &str) -> (StatusCode, Bytes) {
    let request = axum::http::Request::post("/charge")
        .header("authorization", format!("Bearer {token}"))
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    (
        status,
        response.into_body().collect().await.unwrap().to_bytes(),
    )
}

fn key(name: &str) -> StoreKey {
    StoreKey::new("unused", format!("{name}-{}", Token::random().to_hex()))
}

#[tokio::test]
async fn a_retry_with_a_refreshed_token_is_replayed_and_charges_once() {
    let Some((store, table)) = pg_effects::store_and_table(4, "principal_effects").await else {
        return;
    };
    // Authentication outside (added last: it runs first), so the layer sees the principal.
    let app = charges(&store, &table)
        .layer(IdempotencyLayer::new(store.clone()))
        .layer(middleware::from_fn_with_state(issued(), authenticate));
    let k = key("refresh");

    let first = send(&app, "alice-1", k.key()).await;
    assert_eq!(first.0, StatusCode::CREATED);
    // The SDK refreshed the token before retrying.
    let retry = send(&app, "alice-2", k.key()).await;
    assert_eq!(retry, first, "the retry is replayed");
    assert_eq!(
        pg_effects::effects(&store, &table, &k).await,
        1,
        "one charge"
    );

    // Another caller with the same key is another operation, never alice's record.
    let bob = send(&app, "bob-1", k.key()).await;
    assert_eq!(bob.0, StatusCode::CREATED);
    assert_ne!(bob.1, first.1, "bob got alice's stored response");
    assert_eq!(pg_effects::effects(&store, &table, &k).await, 2);
    // A token nobody issued is refused before anything runs or is looked up.
    let forged = send(&app, "alice-forged", k.key()).await;
    assert_eq!(forged.0, StatusCode::UNAUTHORIZED);
    assert_eq!(pg_effects::effects(&store, &table, &k).await, 2);
}

/// The documented fallback: a layer outside the authentication layer sees no principal and
/// scopes by the `Authorization` hash, so a refreshed token is a new scope and the retry
/// runs again. This is why the authentication layer must run first.
#[tokio::test]
async fn without_a_principal_a_refreshed_token_is_a_new_scope() {
    let Some((store, table)) = pg_effects::store_and_table(4, "principal_effects").await else {
        return;
    };
    let app = charges(&store, &table)
        .layer(middleware::from_fn_with_state(issued(), authenticate))
        .layer(IdempotencyLayer::new(store.clone()));
    let k = key("fallback");
    assert_eq!(send(&app, "alice-1", k.key()).await.0, StatusCode::CREATED);
    assert_eq!(send(&app, "alice-2", k.key()).await.0, StatusCode::CREATED);
    assert_eq!(pg_effects::effects(&store, &table, &k).await, 2);
}
