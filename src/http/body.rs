//! Response bodies: the boxed type the layer answers with, and reading a body up to a limit.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};

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

/// A body read as far as a limit allows.
pub(crate) enum Collected<B> {
    /// The whole body, within the limit.
    Complete(Bytes),
    /// Over the limit: what was read, and the unread rest.
    TooLarge { read: Bytes, rest: B },
    /// The body failed while being read.
    Failed(BoxError),
}

/// Reads `body` into memory unless it grows past `limit` bytes. Trailers are not kept.
pub(crate) async fn collect_up_to<B>(mut body: B, limit: usize) -> Collected<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let mut read = BytesMut::new();
    while let Some(frame) = body.frame().await {
        match frame {
            Err(error) => return Collected::Failed(error.into()),
            Ok(frame) => {
                if let Ok(data) = frame.into_data() {
                    read.extend_from_slice(&data);
                    if read.len() > limit {
                        return Collected::TooLarge {
                            read: read.freeze(),
                            rest: body,
                        };
                    }
                }
            }
        }
    }
    Collected::Complete(read.freeze())
}

pin_project_lite::pin_project! {
    /// Bytes already read, then the rest of the body they came from.
    pub(crate) struct Prefixed<B> {
        prefix: Option<Bytes>,
        #[pin]
        rest: B,
    }
}

impl<B> Prefixed<B> {
    pub(crate) fn new(prefix: Bytes, rest: B) -> Self {
        Self {
            prefix: Some(prefix),
            rest,
        }
    }
}

impl<B> Body for Prefixed<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        if let Some(prefix) = this.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        this.rest.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let rest = self.rest.size_hint();
        let prefix = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower() + prefix);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + prefix);
        }
        hint
    }
}
