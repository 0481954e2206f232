//! The answers the layer gives instead of running (or replaying) the inner service.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

use super::key::InvalidKey;
use crate::problem::Problem;

/// Why the layer answered by itself. Rendered as RFC 9457 problem details by
/// [`Rejection::into_http_response`] (and, with the `axum` feature, axum's `IntoResponse`);
/// replace the rendering with
/// [`IdempotencyLayer::on_rejection`](super::IdempotencyLayer::on_rejection).
///
/// | rejection | status | `type` |
/// |---|---|---|
/// | [`MissingKey`](Self::MissingKey) | 400 | `urn:tower-idempotency:missing-key` |
/// | [`MissingMessageKey`](Self::MissingMessageKey) | 400 | `urn:tower-idempotency:missing-key` |
/// | [`InvalidKey`](Self::InvalidKey) | 400 | `urn:tower-idempotency:invalid-key` |
/// | [`MissingIdentity`](Self::MissingIdentity) | 400 | `urn:tower-idempotency:missing-identity` |
/// | [`BodyUnreadable`](Self::BodyUnreadable) | 400 | `urn:tower-idempotency:body-unreadable` |
/// | [`BodyTooLarge`](Self::BodyTooLarge) | 413 | `urn:tower-idempotency:body-too-large` |
/// | [`KeyReused`](Self::KeyReused) | 422 | `urn:tower-idempotency:key-reused` |
/// | [`InProgress`](Self::InProgress) | 409 + `Retry-After` | `urn:tower-idempotency:in-progress` |
/// | [`StoreBusy`](Self::StoreBusy) | 409 + `Retry-After` | `urn:tower-idempotency:store-busy` |
/// | [`ResponseNotStored`](Self::ResponseNotStored) | 409 | `urn:tower-idempotency:response-not-stored` |
/// | [`StoreUnavailable`](Self::StoreUnavailable) | 503 + `Retry-After` | `urn:tower-idempotency:store-unavailable` |
/// | [`RecordUnreadable`](Self::RecordUnreadable) | 500 | `urn:tower-idempotency:record-unreadable` |
/// | [`HandlerPanicked`](Self::HandlerPanicked) | 500 | `urn:tower-idempotency:handler-panicked` |
/// | [`ResponseBodyFailed`](Self::ResponseBodyFailed) | 500 | `urn:tower-idempotency:response-body-failed` |
/// | [`NotCommitted`](Self::NotCommitted) | 503 + `Retry-After` | `urn:tower-idempotency:not-committed` |
/// | [`OutcomeUnknown`](Self::OutcomeUnknown) | 503 + `Retry-After` | `urn:tower-idempotency:outcome-unknown` |
/// | [`OutcomeUnknownWithoutKey`](Self::OutcomeUnknownWithoutKey) | 500 | `urn:tower-idempotency:outcome-unknown` |
/// | [`TransactionHeld`](Self::TransactionHeld) | 500 | `urn:tower-idempotency:transaction-held` |
/// | [`NotUnary`](Self::NotUnary) | 400 | `urn:tower-idempotency:not-unary` |
/// | [`DeadlineExceeded`](Self::DeadlineExceeded) | 504 | `urn:tower-idempotency:deadline-exceeded` |
///
/// On a gRPC call they are gRPC statuses instead (see the [`grpc`](crate::http::grpc) docs).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Rejection {
    /// The route requires an idempotency key and the request has none.
    #[error("the route requires an Idempotency-Key header and the request has none")]
    MissingKey,
    /// gRPC: the method takes its key from the request message
    /// ([`key_from_message`](super::IdempotencyLayer::key_from_message)), the route requires
    /// one, and the call carries none, in its message or as metadata.
    #[error("the method requires an idempotency key in its request message (or as idempotency-key metadata) and the call has none")]
    MissingMessageKey,
    /// The key header is malformed.
    #[error("the Idempotency-Key header is malformed: {0}")]
    InvalidKey(InvalidKey),
    /// The request has a key but no caller identity to scope it by (no
    /// [`Principal`](super::Principal) and no `Authorization` header, with the default
    /// scope), and the layer does not allow a shared anonymous
    /// scope. Nothing was run or looked up.
    #[error("the request has an idempotency key but no caller identity to scope it by")]
    MissingIdentity,
    /// The request body could not be read (the client went away mid-upload, ...).
    #[error("the request body could not be read")]
    BodyUnreadable,
    /// The request body is over the fingerprint limit; nothing was run.
    #[error("the request body is over the {limit}-byte fingerprint limit; nothing was run")]
    BodyTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The key was first used with a different request.
    #[error("the idempotency key was first used with a different request")]
    KeyReused,
    /// The first request with this key is still running.
    #[error(
        "the first request with this idempotency key is still running; retry after {retry_after:?}"
    )]
    InProgress {
        /// Suggested delay before retrying.
        retry_after: Duration,
    },
    /// The database is busy with other requests' writes (one writer at a time, as on SQLite)
    /// and this request's turn did not come within its wait; nothing was run. A conflict with
    /// the other writers, not an outage: retry after `retry_after`.
    #[error("the database is busy with other requests' writes; nothing was run: retry after {retry_after:?}")]
    StoreBusy {
        /// Suggested delay before retrying.
        retry_after: Duration,
    },
    /// The first request with this key completed with `status`, but its response was over the
    /// storage limit, so it cannot be replayed. The operation is NOT run again.
    #[error("the first request with this idempotency key completed with {status}, but its response was too large to store; it is not run again")]
    ResponseNotStored {
        /// The original response's status.
        status: StatusCode,
    },
    /// The idempotency store is unreachable; nothing was run.
    #[error("the idempotency store is unavailable; nothing was run: retry after {retry_after:?}")]
    StoreUnavailable {
        /// Suggested delay before retrying.
        retry_after: Duration,
    },
    /// The store holds a record under this key that cannot be read (damaged, or written by
    /// something else), or one whose stored response cannot be decoded. The request it
    /// belongs to may have run, so this one was not run; retrying cannot help (no
    /// `Retry-After`) until an operator removes the record with
    /// [`Store::forget`](crate::store::Store::forget).
    #[error("the record stored under this idempotency key cannot be read; the request it belongs to may have run, so this one was not; an operator must clear the record")]
    RecordUnreadable,
    /// The inner service panicked; its claim was released, so a retry runs it again.
    #[error("the handler panicked; its claim was released, so a retry runs it again")]
    HandlerPanicked,
    /// The inner service's response body failed while being read; its claim was released.
    /// The layer itself no longer answers with it: responses stream through to their caller,
    /// so a body that fails mid-stream reaches the caller as a broken body (and the key is
    /// released). Kept for custom renderers that match on it.
    #[error("the handler's response body failed; its claim was released")]
    ResponseBodyFailed,
    /// Transactional mode: the handler ran, but its transaction (its writes, the claim and the
    /// response) could not be committed, so nothing of it persists. A retry runs it again.
    #[error("the handler ran but its transaction could not be committed; nothing persists: retry after {retry_after:?}")]
    NotCommitted {
        /// Suggested delay before retrying.
        retry_after: Duration,
    },
    /// Transactional mode: the handler ran, but the connection broke (or the database stopped
    /// answering) while its transaction was committing, so whether it committed is unknown.
    /// The key is not held either way: a retry with the same key replays the committed
    /// response, or runs once if nothing committed.
    #[error("the handler ran but the connection broke while its transaction committed; the outcome is unknown: retry after {retry_after:?} with the same key")]
    OutcomeUnknown {
        /// Suggested delay before retrying.
        retry_after: Duration,
    },
    /// Transactional mode, a request sent without a key: the handler ran, but the connection
    /// broke while its transaction was committing, so whether it committed is unknown. Unlike
    /// [`OutcomeUnknown`](Self::OutcomeUnknown), nothing records a request without a key: a
    /// retry may apply it a second time. No `Retry-After`: check its effect before retrying,
    /// and send an idempotency key to make retries safe.
    #[error("the handler ran but the connection broke while its transaction committed; the outcome is unknown, and the request had no idempotency key, so a retry may apply it twice")]
    OutcomeUnknownWithoutKey,
    /// Transactional mode: the handler still held the transaction after it answered (it kept
    /// the guard, or a task it spawned did), so nothing was committed.
    #[error("the handler still held the transaction after it answered, so nothing was committed")]
    TransactionHeld,
    /// gRPC: a keyed call whose request is not exactly one message (a client stream), which
    /// has no single request to fingerprint and replay; nothing was run.
    #[error("idempotency keys apply to unary calls only: the request is not exactly one message; nothing was run")]
    NotUnary,
    /// gRPC: the call's `grpc-timeout` passed while it waited for the first call with its
    /// key; it ran nothing.
    #[error("the call's deadline passed while it waited for the first call with its idempotency key; nothing was run")]
    DeadlineExceeded,
}

impl Rejection {
    /// The HTTP status of the default rendering.
    pub fn status(&self) -> StatusCode {
        self.problem().status()
    }

    /// The suggested `Retry-After` delay, for rejections a retry can cure.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Rejection::InProgress { retry_after }
            | Rejection::StoreBusy { retry_after }
            | Rejection::StoreUnavailable { retry_after }
            | Rejection::NotCommitted { retry_after }
            | Rejection::OutcomeUnknown { retry_after } => Some(*retry_after),
            _ => None,
        }
    }

    /// The problem details of the default rendering.
    pub fn problem(&self) -> Problem {
        use StatusCode as S;
        let (status, type_uri, title, detail) = match self {
            Rejection::MissingKey => (
                S::BAD_REQUEST,
                "urn:tower-idempotency:missing-key",
                "Idempotency key required",
                "this endpoint requires an Idempotency-Key header; send a unique value (e.g. a UUID) per operation and reuse it when retrying".to_owned(),
            ),
            Rejection::MissingMessageKey => (
                S::BAD_REQUEST,
                "urn:tower-idempotency:missing-key",
                "Idempotency key required",
                "this method takes its idempotency key from the request message (its request id field) or the idempotency-key metadata entry, and the call carried neither; set a unique value per operation in the request message and reuse it when retrying".to_owned(),
            ),
            Rejection::MissingIdentity => (
                S::BAD_REQUEST,
                "urn:tower-idempotency:missing-identity",
                "Caller identity required",
                "this request carries an idempotency key but no caller identity (no verified principal, no Authorization header), so its key cannot be kept apart from other callers' keys; nothing was run — send the request with your credentials".to_owned(),
            ),
            Rejection::InvalidKey(why) => (S::BAD_REQUEST, "urn:tower-idempotency:invalid-key", "Invalid idempotency key", why.to_string()),
            Rejection::BodyUnreadable => (
                S::BAD_REQUEST,
                "urn:tower-idempotency:body-unreadable",
                "Request body could not be read",
                "the request body ended early or could not be read; nothing was run, send the request again".to_owned(),
            ),
            Rejection::BodyTooLarge { limit } => (
                S::PAYLOAD_TOO_LARGE,
                "urn:tower-idempotency:body-too-large",
                "Request body too large",
                format!("the request body is over {limit} bytes; nothing was run"),
            ),
            Rejection::KeyReused => (
                S::UNPROCESSABLE_ENTITY,
                "urn:tower-idempotency:key-reused",
                "Idempotency key reused",
                "this idempotency key was already used with a different request (method, path, query or body); use a new key for a new request".to_owned(),
            ),
            Rejection::InProgress { retry_after } => (
                S::CONFLICT,
                "urn:tower-idempotency:in-progress",
                "Request in progress",
                format!("a request with this idempotency key is still being processed; retry in {} s to get its result", retry_after_secs(*retry_after)),
            ),
            Rejection::StoreBusy { retry_after } => (
                S::CONFLICT,
                "urn:tower-idempotency:store-busy",
                "Database busy",
                format!("the database is busy with other requests' writes and this request's turn did not come in time; nothing was run: retry in {} s with the same key", retry_after_secs(*retry_after)),
            ),
            Rejection::ResponseNotStored { status } => (
                S::CONFLICT,
                "urn:tower-idempotency:response-not-stored",
                "Original response not stored",
                format!("the request with this idempotency key already completed with status {}, but its response was too large to keep for replay; it was not run again — fetch the resource instead", status.as_u16()),
            ),
            Rejection::StoreUnavailable { retry_after } => (
                S::SERVICE_UNAVAILABLE,
                "urn:tower-idempotency:store-unavailable",
                "Idempotency store unavailable",
                format!("the request was not run because its idempotency key could not be recorded; retry in {} s", retry_after_secs(*retry_after)),
            ),
            Rejection::RecordUnreadable => (
                S::INTERNAL_SERVER_ERROR,
                "urn:tower-idempotency:record-unreadable",
                "Stored record unreadable",
                "the record stored under this idempotency key cannot be read (it is damaged, or was written by something else); the request it belongs to may have run, so this one was not run, and retrying will not help until the service's operators clear the record: report the idempotency key to them".to_owned(),
            ),
            Rejection::HandlerPanicked => (
                S::INTERNAL_SERVER_ERROR,
                "urn:tower-idempotency:handler-panicked",
                "Internal error",
                "the request failed; it was not recorded, so retrying with the same key runs it again".to_owned(),
            ),
            Rejection::ResponseBodyFailed => (
                S::INTERNAL_SERVER_ERROR,
                "urn:tower-idempotency:response-body-failed",
                "Internal error",
                "the response could not be produced; it was not recorded, so retrying with the same key runs it again".to_owned(),
            ),
            Rejection::NotCommitted { retry_after } => (
                S::SERVICE_UNAVAILABLE,
                "urn:tower-idempotency:not-committed",
                "Request not committed",
                format!("the request ran but its transaction could not be committed, so nothing of it persists; retry in {} s with the same key", retry_after_secs(*retry_after)),
            ),
            Rejection::OutcomeUnknown { retry_after } => (
                S::SERVICE_UNAVAILABLE,
                "urn:tower-idempotency:outcome-unknown",
                "Request outcome unknown",
                format!("the request ran but the connection to the database broke while it was committing; outcome unknown; retry with the same key in {} s: a committed request is replayed, one that did not commit runs once", retry_after_secs(*retry_after)),
            ),
            Rejection::OutcomeUnknownWithoutKey => (
                S::INTERNAL_SERVER_ERROR,
                "urn:tower-idempotency:outcome-unknown",
                "Request outcome unknown",
                "the request ran but the connection to the database broke while it was committing, so whether it took effect is unknown; it carried no idempotency key, so nothing recorded it and a retry may apply it twice: check whether it took effect before retrying, and send an Idempotency-Key header to make retries safe".to_owned(),
            ),
            Rejection::TransactionHeld => (
                S::INTERNAL_SERVER_ERROR,
                "urn:tower-idempotency:transaction-held",
                "Internal error",
                "the request failed and nothing of it was committed, so retrying with the same key runs it again".to_owned(),
            ),
            Rejection::NotUnary => (
                S::BAD_REQUEST,
                "urn:tower-idempotency:not-unary",
                "Streaming call",
                "idempotency keys apply to unary calls only; send streaming calls without a key".to_owned(),
            ),
            Rejection::DeadlineExceeded => (
                S::GATEWAY_TIMEOUT,
                "urn:tower-idempotency:deadline-exceeded",
                "Deadline exceeded",
                "the request's deadline passed while it waited for the first request with its idempotency key; nothing was run".to_owned(),
            ),
        };
        Problem::new(status, type_uri, title).detail(detail)
    }

    /// The default rendering: problem+json, plus `Retry-After` where a retry can cure it.
    pub fn into_http_response(self) -> Response<Bytes> {
        let retry_after = self.retry_after();
        let mut response = self.problem().into_http_response();
        if let Some(delay) = retry_after {
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from(retry_after_secs(delay)),
            );
        }
        response
    }
}

/// `Retry-After` takes whole seconds; round up so a client never comes back too early.
fn retry_after_secs(delay: Duration) -> u64 {
    delay.as_secs() + u64::from(delay.subsec_nanos() > 0)
}

#[cfg(feature = "axum")]
impl axum_core::response::IntoResponse for Rejection {
    fn into_response(self) -> axum_core::response::Response {
        self.into_http_response().map(axum_core::body::Body::from)
    }
}
