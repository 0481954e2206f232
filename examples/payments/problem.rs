//! The example's own problem+json answers (the layer renders its own).

use axum::response::{IntoResponse, Response};
use http::StatusCode;
use tower_idempotency::{problem::Problem, DoNotStore};

pub fn not_found(id: &str) -> Response {
    Problem::new(
        StatusCode::NOT_FOUND,
        "urn:payments:not-found",
        "Payment not found",
    )
    .detail(format!("no payment with id {id:?}"))
    .into_response()
}

/// 422 for a body that is not a valid charge. Marked `DoNotStore`: nothing happened, so the
/// client may fix the body and resend it under the same key.
pub fn invalid_body(detail: impl Into<String>) -> Response {
    let mut response = Problem::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "urn:payments:invalid-body",
        "Invalid payment",
    )
    .detail(detail)
    .into_response();
    response.extensions_mut().insert(DoNotStore);
    response
}

/// The flaky processor of `PAYMENTS_FAIL_FIRST`.
pub fn processor_unavailable() -> Response {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "urn:payments:processor-unavailable",
        "Payment processor unavailable",
    )
    .detail("the card processor did not answer; nothing was charged, retry with the same key")
    .into_response()
}

pub fn lease_lost() -> Response {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "urn:payments:lease-lost",
        "Request took too long",
        )
    .detail("this request's hold on its idempotency key ran out before it charged; nothing was charged, retry with the same key to get the operation's outcome")
    .into_response()
}

/// A failed read or write of the payments: 503 with `Retry-After` when the database was out
/// of reach or ended the session (see `outage`), 500 for anything else.
pub fn storage_failed(error: &(dyn std::error::Error + 'static)) -> Response {
    if !crate::outage::is_outage(error) {
        tracing::error!(%error, "payments storage failed");
        return Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "urn:payments:internal",
            "Internal error",
        )
        .detail("the payment could not be read or written; retry with the same key")
        .into_response();
    }
    tracing::warn!(%error, "payments storage unavailable");
    let mut response = Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "urn:payments:storage-unavailable",
        "Payments storage unavailable",
    )
    .detail("the payments database could not be reached; retry with the same key in a second")
    .into_response();
    response.headers_mut().insert(
        http::header::RETRY_AFTER,
        http::HeaderValue::from_static("1"),
    );
    response
}

/// 401 for a POST or PATCH without `Authorization`: every operation belongs to a caller.
pub fn unauthorized() -> Response {
    let mut response = Problem::new(
        StatusCode::UNAUTHORIZED,
        "urn:payments:unauthorized",
        "Caller identity required",
    )
    .detail("send an Authorization header (e.g. `Bearer alice`); nothing was recorded")
    .into_response();
    response.headers_mut().insert(
        http::header::WWW_AUTHENTICATE,
        http::HeaderValue::from_static("Bearer"),
    );
    response
}
