//! A gRPC service written out by hand, as tonic's generated code would be: one tower service,
//! named `test.Payments`, that hands each call (its body made tonic's) to a route of the
//! test's, which picks the method's handler.

use std::{convert::Infallible, future::Future, pin::Pin, sync::Arc};

use bytes::Bytes;

pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// What a call is answered with.
pub type Route = Arc<
    dyn Fn(http::Request<tonic::body::Body>) -> BoxFuture<http::Response<tonic::body::Body>>
        + Send
        + Sync,
>;

/// The service tonic's server serves: see the module docs.
#[derive(Clone)]
pub struct Handwritten(pub Route);

impl tonic::server::NamedService for Handwritten {
    const NAME: &'static str = "test.Payments";
}

impl<B> tower::Service<http::Request<B>> for Handwritten
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let answer = (self.0)(request.map(tonic::body::Body::new));
        Box::pin(async move { Ok(answer.await) })
    }
}
