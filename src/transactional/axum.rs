//! The axum extractor for the transaction lent to a handler.

use std::ops::{Deref, DerefMut};

use axum_core::{
    extract::FromRequestParts,
    response::{IntoResponse, Response},
};
use http::{request::Parts, StatusCode};

use super::slot::{LockError, TxGuard, TxSlot};
use crate::{problem::Problem, store::StoreError};

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

/// Why [`Tx`] could not be extracted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TxRejection {
    /// The request has no transaction to lend: the route is not under a transactional
    /// [`IdempotencyLayer`](crate::IdempotencyLayer), its method is not one the layer covers
    /// (GET, ...), or the transaction was already taken back. 500 problem+json: a wiring
    /// mistake, not the client's.
    #[error("no idempotency transaction for this request: put the route under IdempotencyLayer::transactional and use a method the layer covers")]
    Missing,
    /// A request without a key: its transaction could not be begun (the database is
    /// unreachable). 503 problem+json with `Retry-After: 1`.
    #[error("the request's transaction could not be begun; retry")]
    Unavailable(#[source] StoreError),
}

impl IntoResponse for TxRejection {
    fn into_response(self) -> Response {
        let problem = match &self {
            TxRejection::Missing => Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "urn:tower-idempotency:no-transaction",
                "No transaction for this request",
            ),
            TxRejection::Unavailable(_) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "urn:tower-idempotency:store-unavailable",
                "Database unavailable",
            ),
        };
        let retry = matches!(self, TxRejection::Unavailable(_));
        let mut response = problem.detail(self.to_string()).into_response();
        if retry {
            response
                .headers_mut()
                .insert(http::header::RETRY_AFTER, http::HeaderValue::from(1));
        }
        response
    }
}

impl<S: Send + Sync, DB: sqlx::Database> FromRequestParts<S> for Tx<DB> {
    type Rejection = TxRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let slot = parts
            .extensions
            .get::<TxSlot<DB>>()
            .cloned()
            .ok_or(TxRejection::Missing)?;
        slot.lock().await.map(Tx).map_err(|error| match error {
            LockError::Taken => TxRejection::Missing,
            LockError::Begin(source) => {
                tracing::warn!(error = %source, "could not begin the request's transaction");
                TxRejection::Unavailable(source)
            }
        })
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
