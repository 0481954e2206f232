//! Which outcomes are final (stored and replayed) and which release the key for a retry.

use std::sync::Arc;

use http::{HeaderMap, Response, StatusCode};

use super::grpc;

/// Decides whether a response with this status is stored for replay.
pub(crate) type StatusPolicy = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;

/// Decides whether a gRPC call that ended with this `grpc-status` code is stored for replay.
pub(crate) type GrpcStatusPolicy = Arc<dyn Fn(i32) -> bool + Send + Sync>;

/// What a response's head says about storing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Stored and replayed.
    Final,
    /// Not an outcome: the key is released.
    NotFinal,
    /// A gRPC response whose status comes in its trailers: [`trailers_final`] decides when
    /// the body ends.
    ByTrailers,
}

/// Whether `response` is stored, as far as its head tells: [`DoNotStore`], then the HTTP
/// status, then for a gRPC response its `grpc-status` (in the head of a trailers-only answer,
/// else in the trailers to come).
pub(crate) fn outcome<B>(
    response: &Response<B>,
    is_final: &StatusPolicy,
    is_final_grpc: &GrpcStatusPolicy,
) -> Outcome {
    if response.extensions().get::<DoNotStore>().is_some() || !is_final(response.status()) {
        return Outcome::NotFinal;
    }
    if !grpc::is_grpc(response.headers()) {
        return Outcome::Final;
    }
    match grpc::status_of(response.headers()) {
        Some(code) if is_final_grpc(code) => Outcome::Final,
        Some(_) => Outcome::NotFinal,
        None => Outcome::ByTrailers,
    }
}

/// For [`Outcome::ByTrailers`]: whether the trailers the body ended with carry a stored
/// `grpc-status`. A gRPC body that ended without one broke the protocol: not stored.
pub(crate) fn trailers_final(
    trailers: Option<&HeaderMap>,
    is_final_grpc: &GrpcStatusPolicy,
) -> bool {
    trailers
        .and_then(grpc::status_of)
        .is_some_and(|code| is_final_grpc(code))
}

/// Put this in a response's extensions to keep the response from being stored: the claim is
/// released and a retry with the same key runs the handler again. Use it for outcomes that
/// did nothing, such as a validation error the client will fix and resend.
///
/// ```
/// use http::{Response, StatusCode};
/// use tower_idempotency::DoNotStore;
///
/// let mut response = Response::new("amount must be positive");
/// *response.status_mut() = StatusCode::UNPROCESSABLE_ENTITY;
/// response.extensions_mut().insert(DoNotStore);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct DoNotStore;

/// The default: every status is final except server errors (5xx) and the statuses that mean
/// "not processed, try again": 408 Request Timeout, 409 Conflict, 425 Too Early and
/// 429 Too Many Requests.
pub fn is_final_by_default(status: StatusCode) -> bool {
    !(status.is_server_error()
        || matches!(
            status,
            StatusCode::REQUEST_TIMEOUT
                | StatusCode::CONFLICT
                | StatusCode::TOO_EARLY
                | StatusCode::TOO_MANY_REQUESTS
        ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryable_statuses_are_not_final() {
        for code in [500, 502, 503, 504, 408, 409, 425, 429] {
            assert!(
                !is_final_by_default(StatusCode::from_u16(code).unwrap()),
                "{code}"
            );
        }
        for code in [200, 201, 204, 302, 400, 404, 410, 422] {
            assert!(
                is_final_by_default(StatusCode::from_u16(code).unwrap()),
                "{code}"
            );
        }
    }
}
