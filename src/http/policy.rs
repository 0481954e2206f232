//! Which outcomes are final (stored and replayed) and which release the key for a retry.

use std::sync::Arc;

use http::{HeaderMap, Response, StatusCode};

use super::{
    grpc::{self, Protocol},
    grpc_web::WebStatus,
};

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
    /// A gRPC response whose status comes at the end of its body: a [`StatusWatch`] finds it
    /// there and decides.
    ByStatus(StatusIn),
}

/// Where the status of an [`Outcome::ByStatus`] response comes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StatusIn {
    /// gRPC: the HTTP trailers.
    Trailers,
    /// gRPC-web: the trailer frame that ends the body (`text`: a base64 body).
    WebFrame { text: bool },
}

/// Whether `response` is stored, as far as its head tells: [`DoNotStore`], then the HTTP
/// status, then for a gRPC or gRPC-web response its `grpc-status` (in the head of a
/// trailers-only answer, else at the end of the body to come).
pub(crate) fn outcome<B>(
    response: &Response<B>,
    is_final: &StatusPolicy,
    is_final_grpc: &GrpcStatusPolicy,
) -> Outcome {
    if response.extensions().get::<DoNotStore>().is_some() || !is_final(response.status()) {
        return Outcome::NotFinal;
    }
    let protocol = Protocol::of(response.headers());
    if !protocol.is_grpc() {
        return Outcome::Final;
    }
    match grpc::status_of(response.headers()) {
        Some(code) if is_final_grpc(code) => Outcome::Final,
        Some(_) => Outcome::NotFinal,
        None => Outcome::ByStatus(match protocol {
            Protocol::GrpcWeb => StatusIn::WebFrame { text: false },
            Protocol::GrpcWebText => StatusIn::WebFrame { text: true },
            _ => StatusIn::Trailers,
        }),
    }
}

/// Finds the status of an [`Outcome::ByStatus`] response as its body passes.
#[derive(Debug)]
pub(crate) enum StatusWatch {
    /// In the trailers the body ends with.
    Trailers,
    /// In the gRPC-web trailer frame, followed through the body's data.
    Web(Box<WebStatus>),
}

impl StatusWatch {
    pub(crate) fn new(at: StatusIn) -> Self {
        match at {
            StatusIn::Trailers => Self::Trailers,
            StatusIn::WebFrame { text } => Self::Web(Box::new(WebStatus::new(text))),
        }
    }

    /// Follows the next chunk of the body's data.
    pub(crate) fn data(&mut self, data: &[u8]) {
        if let Self::Web(web) = self {
            web.data(data);
        }
    }

    /// True when the data so far ended the call: a gRPC-web trailer frame is complete, and
    /// the chunk that completed it is the call's status, to be handled as trailers are.
    pub(crate) fn ended(&self) -> bool {
        matches!(self, Self::Web(web) if web.ended())
    }

    /// Whether the call, whose body ended (with `trailers`, if any), carried a stored
    /// `grpc-status`. A call that ended without one broke the protocol: not stored.
    pub(crate) fn is_final(
        &self,
        trailers: Option<&HeaderMap>,
        is_final_grpc: &GrpcStatusPolicy,
    ) -> bool {
        let in_trailers = || trailers.and_then(grpc::status_of);
        let code = match self {
            Self::Trailers => in_trailers(),
            Self::Web(web) => web.status().or_else(in_trailers),
        };
        code.is_some_and(|code| is_final_grpc(code))
    }
}

/// For a whole body (`data` and `trailers`) of an [`Outcome::ByStatus`] response: whether it
/// is stored (the transactional mode reads bodies whole).
#[cfg(feature = "sqlx")]
pub(crate) fn body_final(
    at: StatusIn,
    data: &[u8],
    trailers: Option<&HeaderMap>,
    is_final_grpc: &GrpcStatusPolicy,
) -> bool {
    let mut watch = StatusWatch::new(at);
    watch.data(data);
    watch.is_final(trailers, is_final_grpc)
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
