//! Response bodies: the boxed type the layer answers with.

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full, StreamBody};

use crate::BoxError;

/// The body of every response the layer returns.
pub type ResponseBody = UnsyncBoxBody<Bytes, BoxError>;

pub(crate) fn full(bytes: Bytes) -> ResponseBody {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

pub(crate) fn boxed<B>(body: B) -> ResponseBody
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

/// `bytes`, then `trailers`: how a response that ended with trailers is replayed.
pub(crate) fn with_trailers(bytes: Bytes, trailers: HeaderMap) -> ResponseBody {
    let frames = [Frame::data(bytes), Frame::trailers(trailers)];
    StreamBody::new(futures_util::stream::iter(frames.map(Ok::<_, BoxError>))).boxed_unsync()
}
