//! A gRPC call's key taken from its request message (Google AIP-155's `request_id`), for the
//! methods registered with
//! [`IdempotencyLayer::key_from_message`](super::IdempotencyLayer::key_from_message).
//!
//! The message is only known once the body is read, so such a call is read first, its key
//! extracted and checked by the same rules as a header key, and then protected exactly as a
//! call that sent the key as metadata (the read body is handed on, not read twice from the
//! client).

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::{
    answer::render,
    body::{self, ResponseBody},
    bounds::{IncomingBody, OutgoingBody, Wrapped},
    config::Config,
    detach::BoxFuture,
    grpc::{self, Protocol},
    key::validate,
    rejection::Rejection,
    request_body::read_body,
    service::protect,
};
use crate::BoxError;

/// Reads the key out of a request message; `None` when the message carries none.
pub(crate) type MessageKeyFn = Arc<dyn Fn(&[u8]) -> Option<String> + Send + Sync>;

/// The extractor registered for this call's method, when it is a gRPC call to one.
pub(super) fn extractor_for(
    config: &Config,
    request: &Request<impl Sized>,
) -> Option<MessageKeyFn> {
    if config.message_keys.is_empty() || !Protocol::of(request.headers()).is_grpc() {
        return None;
    }
    let path = request.uri().path();
    config
        .message_keys
        .iter()
        .find(|(registered, _)| registered == path)
        .map(|(_, extract)| extract.clone())
}

/// A call to a method keyed by its message that sent no key as metadata: read the message,
/// take its key, then protect the call under it, refuse it, or (no key, key optional) run it
/// unprotected.
pub(super) fn protect_by_message<S, ReqBody, ResBody>(
    inner: S,
    config: Arc<Config>,
    extract: MessageKeyFn,
    request: Request<ReqBody>,
    arrived: tokio::time::Instant,
) -> BoxFuture<Result<Response<ResponseBody>, S::Error>>
where
    S: Wrapped<ReqBody, ResBody>,
    ReqBody: IncomingBody,
    ResBody: OutgoingBody,
{
    Box::pin(async move {
        let (parts, body) = request.into_parts();
        let protocol = Protocol::of(&parts.headers);
        let body = match read_body(&parts.headers, body, config.max_request_body).await {
            Ok(body) => body,
            Err(rejection) => return Ok(render(&config, protocol, rejection)),
        };
        let key = match grpc::request_message(protocol, &body) {
            // The method was registered as unary: a stream of messages is not a call to it.
            None => return Ok(render(&config, protocol, Rejection::NotUnary)),
            // A compressed message is the service's to decode; its key must come as metadata.
            Some((true, _)) => None,
            Some((false, message)) => extract(&message),
        };
        let request = Request::from_parts(parts, ReqBody::from(body));
        match key.map(|key| validate(key.into_bytes())) {
            Some(Ok(key)) => protect(inner, config, key, request, arrived).await,
            Some(Err(invalid)) => Ok(render(&config, protocol, Rejection::InvalidKey(invalid))),
            None if config.key_required => {
                Ok(render(&config, protocol, Rejection::MissingMessageKey))
            }
            None => unprotected(inner, config, request).await,
        }
    })
}

/// A call without a key where the key is optional: as on HTTP, it runs unprotected (in the
/// transactional mode, still inside a transaction of its own).
async fn unprotected<S, ReqBody, ResBody>(
    mut inner: S,
    config: Arc<Config>,
    request: Request<ReqBody>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    #[cfg(feature = "sqlx")]
    if let Some(mode) = config.transactional.clone() {
        return super::service::unkeyed(inner, mode, request, config).await;
    }
    #[cfg(not(feature = "sqlx"))]
    let _ = config;
    inner
        .call(request)
        .await
        .map(|response| response.map(body::boxed))
}
