//! What the layer's request path needs of the service it wraps and of the two bodies, named
//! once. Each trait is implemented for every type that meets its bounds, so a function on the
//! path says `S: Wrapped<ReqBody, ResBody>, ReqBody: IncomingBody, ResBody: OutgoingBody`
//! instead of repeating nine lines; the public `Service` impl spells them out for its readers.

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use crate::BoxError;

/// The inner service: cloned into each request's work, which may outlive the caller's task.
pub(super) trait Wrapped<ReqBody, ResBody>:
    Service<
        Request<ReqBody>,
        Response = Response<ResBody>,
        Future: Send + 'static,
        Error: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S, ReqBody, ResBody> Wrapped<ReqBody, ResBody> for S where
    S: Service<
            Request<ReqBody>,
            Response = Response<ResBody>,
            Future: Send + 'static,
            Error: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}

/// The request body: read whole (to fingerprint it), then handed on rebuilt from its bytes.
pub(super) trait IncomingBody:
    Body<Data: Send, Error: Into<BoxError>> + From<Bytes> + Send + 'static
{
}

impl<B> IncomingBody for B where
    B: Body<Data: Send, Error: Into<BoxError>> + From<Bytes> + Send + 'static
{
}

/// The inner service's response body: teed into the stored record while it streams out.
pub(super) trait OutgoingBody:
    Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static
{
}

impl<B> OutgoingBody for B where B: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static {}
