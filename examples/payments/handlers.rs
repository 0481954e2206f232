//! The routes.

use std::sync::atomic::Ordering;

use axum::{
    extract::{Path, Request, State},
    http::{header, Extensions, HeaderMap, HeaderValue, Method, StatusCode},
    middleware::Next,
    response::{IntoResponse, Response},
    Json,
};
use bytes::Bytes;
use serde::Deserialize;
use tower_idempotency::{
    engine::ClaimStatus, steps::KeyOwner, version::RequireIfMatch, DoNotStore,
};

use crate::{payments::Payment, problem, App};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewPayment {
    amount: i64,
    currency: String,
}

/// Answers 401 to a POST or PATCH without `Authorization`, before the idempotency layer: the
/// caller is what scopes keys, and this service has no anonymous callers.
pub async fn require_caller(request: Request, next: Next) -> Response {
    let writes = request.method() == Method::POST || request.method() == Method::PATCH;
    if writes && !request.headers().contains_key(header::AUTHORIZATION) {
        return problem::unauthorized();
    }
    next.run(request).await
}

/// `POST /payments`: validate, then record exactly one charge.
pub async fn create(
    State(app): State<App>,
    headers: HeaderMap,
    extensions: Extensions,
    body: Bytes,
) -> Response {
    let new = match parse(&body) {
        Ok(new) => new,
        Err(detail) => return problem::invalid_body(detail),
    };
    if let Some(processor) = &app.processor {
        let owner = extensions.get::<KeyOwner>();
        return processor
            .create(&headers, owner, new.amount, &new.currency)
            .await;
    }
    let call = app.create_calls.fetch_add(1, Ordering::SeqCst);
    if call < app.config.fail_first {
        return problem::processor_unavailable();
    }
    if !app.config.handler_delay.is_zero() {
        tracing::info!(delay = ?app.config.handler_delay, "charging after PAYMENTS_HANDLER_DELAY_MS");
        tokio::time::sleep(app.config.handler_delay).await;
    }
    // The last moment to step back: a claim whose lease ran out while this request waited
    // (a stalled process, a store out of reach) may already be run by a duplicate elsewhere.
    // Charging now would be the second charge the separate mode cannot take back. The check
    // narrows the window to the charge itself; only the transactional mode closes it.
    if extensions
        .get::<ClaimStatus>()
        .is_some_and(ClaimStatus::is_lost)
    {
        return problem::lease_lost();
    }
    let created = app
        .payments
        .create(new.amount, &new.currency, &extensions)
        .await;
    // The crash window between the charge and its record: in the transactional mode the
    // charge is written but not committed yet; in the separate mode it is committed and the
    // key not yet completed.
    if !app.config.delay_after_charge.is_zero() {
        tracing::info!(
            delay = ?app.config.delay_after_charge,
            "charge written; answering after PAYMENTS_DELAY_AFTER_CHARGE_MS"
        );
        tokio::time::sleep(app.config.delay_after_charge).await;
    }
    match created {
        Ok(payment) => {
            let location = format!("/payments/{}", payment.id);
            let mut response = with_etag(StatusCode::CREATED, &payment);
            if let Ok(location) = HeaderValue::from_str(&location) {
                response.headers_mut().insert(header::LOCATION, location);
            }
            response
        }
        Err(error) => problem::storage_failed(&*error),
    }
}

fn parse(body: &[u8]) -> Result<NewPayment, String> {
    let new: NewPayment = serde_json::from_slice(body).map_err(|e| {
        format!("expected {{\"amount\": <integer>, \"currency\": \"<ISO 4217 code>\"}}: {e}")
    })?;
    if !(1..=1_000_000).contains(&new.amount) {
        return Err(format!(
            "amount must be an integer from 1 to 1000000, got {}",
            new.amount
        ));
    }
    if new.currency.len() != 3 || !new.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(format!(
            "currency must be 3 uppercase letters, got {:?}",
            new.currency
        ));
    }
    Ok(new)
}

/// `GET /payments/{id}`.
pub async fn read(State(app): State<App>, Path(id): Path<String>) -> Response {
    match app.payments.get(&id).await {
        Ok(Some(payment)) => with_etag(StatusCode::OK, &payment),
        Ok(None) => problem::not_found(&id),
        Err(error) => problem::storage_failed(&*error),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StatusChange {
    status: String,
}

/// `PATCH /payments/{id}`: a state transition, only from the version the client last saw.
///
/// `RequireIfMatch` answers 428 when `If-Match` is missing (and 400 when it is malformed).
/// The update is one compare-and-set: 412 with the current ETag if someone changed the payment
/// since, 404 if there is none.
pub async fn update(
    State(app): State<App>,
    Path(id): Path<String>,
    RequireIfMatch(preconditions): RequireIfMatch,
    extensions: Extensions,
    body: Bytes,
) -> Response {
    let change: StatusChange = match serde_json::from_slice(&body) {
        Ok(change) => change,
        Err(e) => {
            return problem::invalid_body(format!(
                "expected {{\"status\": \"paid\" | \"refunded\" | \"failed\"}}: {e}"
            ))
        }
    };
    if !matches!(change.status.as_str(), "paid" | "refunded" | "failed") {
        return problem::invalid_body(format!(
            "status must be \"paid\", \"refunded\" or \"failed\", got {:?}",
            change.status
        ));
    }
    let outcome = match app
        .payments
        .set_status(&id, preconditions.expected(), &change.status, &extensions)
        .await
    {
        Ok(outcome) => outcome,
        Err(error) => return problem::storage_failed(&*error),
    };
    match outcome.into_http() {
        Ok((_, Some(payment))) => with_etag(StatusCode::OK, &payment),
        // The database could not hand the row back (MySQL re-reads it): read it.
        Ok((_, None)) => read(State(app), Path(id)).await,
        Err(rejection) => {
            // Nothing changed (412 / 404): not worth replaying, so a retry under the same
            // Idempotency-Key with a fresh If-Match is evaluated anew.
            let mut response = rejection.into_response();
            response.extensions_mut().insert(DoNotStore);
            response
        }
    }
}

/// `GET /stats`.
pub async fn stats(State(app): State<App>) -> Response {
    match app.payments.charges().await {
        Ok(charges) => Json(serde_json::json!({ "charges": charges })).into_response(),
        Err(error) => problem::storage_failed(&*error),
    }
}

/// The payment as JSON with its version as a strong ETag.
fn with_etag(status: StatusCode, payment: &Payment) -> Response {
    let etag = format!("\"{}\"", payment.version);
    let mut response = (status, Json(payment)).into_response();
    if let Ok(etag) = HeaderValue::from_str(&etag) {
        response.headers_mut().insert(header::ETAG, etag);
    }
    response
}
