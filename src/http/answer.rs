//! The answers the layer gives without running the inner service: a rejection rendered the
//! way the layer is configured, and a stored outcome replayed.

use bytes::Bytes;
use http::{HeaderValue, Response};

use super::{
    body::{self, ResponseBody},
    config::{Config, IDEMPOTENT_REPLAYED},
    grpc::{self, Protocol},
    rejection::Rejection,
    replay::{self, StoredResponse},
};
use crate::engine::EngineError;

/// Renders `rejection` the way the layer was configured to, or as a gRPC status on a gRPC or
/// gRPC-web call (`protocol`), which no HTTP error body would reach.
pub(super) fn render(
    config: &Config,
    protocol: Protocol,
    rejection: Rejection,
) -> Response<ResponseBody> {
    crate::metrics::http_rejection(&rejection);
    if protocol.is_grpc() {
        return grpc::rejection_response::<Bytes>(&rejection, protocol).map(body::full);
    }
    (config.rejection)(rejection).map(body::full)
}

/// The rejection for a request the engine could neither run nor replay.
pub(super) fn rejection_for(error: EngineError) -> Rejection {
    match error {
        EngineError::FingerprintMismatch => Rejection::KeyReused,
        EngineError::InProgress { retry_after } => Rejection::InProgress { retry_after },
        EngineError::Busy { retry_after } => Rejection::StoreBusy { retry_after },
        EngineError::Store { retry_after, .. } => Rejection::StoreUnavailable { retry_after },
        EngineError::Unreadable { .. } => Rejection::RecordUnreadable,
    }
}

/// A stored outcome, answered to a duplicate.
pub(super) fn replay(
    config: &Config,
    protocol: Protocol,
    payload: Bytes,
) -> Response<ResponseBody> {
    match replay::decode(payload) {
        Ok(StoredResponse::Response {
            status,
            headers,
            body,
            trailers,
        }) => {
            let body = match trailers {
                None => body::full(body),
                Some(trailers) => body::with_trailers(body, *trailers),
            };
            let mut response = Response::new(body);
            *response.status_mut() = status;
            *response.headers_mut() = headers;
            if config.mark_replayed {
                response
                    .headers_mut()
                    .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            }
            response
        }
        Ok(StoredResponse::NotStored { status }) => {
            render(config, protocol, Rejection::ResponseNotStored { status })
        }
        Err(error) => {
            // Permanent: the same bytes are read for every retry until the record is forgotten.
            tracing::error!(%error, "the stored response cannot be decoded; answering record-unreadable until an operator forgets the record (Store::forget)");
            crate::metrics::request(crate::metrics::RECORD_UNREADABLE);
            render(config, protocol, Rejection::RecordUnreadable)
        }
    }
}
