//! The axum extractor for the transaction lent to a handler.

use std::ops::{Deref, DerefMut};

use axum_core::{
    extract::FromRequestParts,
    response::{IntoResponse, Response},
};
use http::{request::Parts, StatusCode};

use super::slot::{TxGuard, TxSlot};
use crate::problem::Problem;

/// The transaction a transactional [`IdempotencyLayer`](crate::IdempotencyLayer) opened for
/// this request: run the handler's queries on it (`.execute(&mut *tx)`). Its writes commit
/// together with the stored response, or not at all.
///
/// ```no_run
/// use axum::{routing::post, Router};
/// use sqlx::Postgres;
/// use tower_idempotency::{store::PostgresStore, transactional::{Transactional, Tx}, IdempotencyLayer};
///
/// async fn charge(mut tx: Tx<Postgres>) -> Result<&'static str, String> {
///     sqlx::query("INSERT INTO charges (amount) VALUES (1200)")
///         .execute(&mut *tx)
///         .await
///         .map_err(|e| e.to_string())?;
///     Ok("charged")
/// }
///
/// # async fn app(pool: sqlx::PgPool) {
/// let layer = IdempotencyLayer::transactional(Transactional::new(PostgresStore::new(pool)));
/// let app: Router = Router::new().route("/charges", post(charge)).layer(layer.require_key());
/// # }
/// ```
pub struct Tx<DB: sqlx::Database>(TxGuard<DB>);

/// The request has no transaction to lend: the route is not under a transactional
/// [`IdempotencyLayer`](crate::IdempotencyLayer), or its method is not one the layer covers
/// (GET, ...), or the transaction was already taken. Answers 500 problem+json: it is a
/// wiring mistake, not the client's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no idempotency transaction for this request: put the route under IdempotencyLayer::transactional and use a method the layer covers")]
pub struct NoTransaction;

impl IntoResponse for NoTransaction {
    fn into_response(self) -> Response {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "urn:tower-idempotency:no-transaction",
            "No transaction for this request",
        )
        .detail(self.to_string())
        .into_response()
        .map(axum_core::body::Body::from)
    }
}

impl<S: Send + Sync, DB: sqlx::Database> FromRequestParts<S> for Tx<DB> {
    type Rejection = NoTransaction;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let slot = parts
            .extensions
            .get::<TxSlot<DB>>()
            .cloned()
            .ok_or(NoTransaction)?;
        slot.lock().await.map(Tx).ok_or(NoTransaction)
    }
}

impl<DB: sqlx::Database> Deref for Tx<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        &self.0
    }
}

impl<DB: sqlx::Database> DerefMut for Tx<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        &mut self.0
    }
}

impl<DB: sqlx::Database> std::fmt::Debug for Tx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx").finish_non_exhaustive()
    }
}
