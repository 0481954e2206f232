//! Reading a response body into memory up to a limit, before anything of it is sent: what
//! the transactional mode needs, since the client may only see an answer whose record has
//! committed. (The separate mode streams instead: see `tee`.)

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

use crate::BoxError;

/// A body read as far as a limit allows.
pub(crate) enum Collected<B> {
    /// The whole body within the limit, and the trailers it ended with.
    Complete {
        data: Bytes,
        trailers: Option<HeaderMap>,
    },
    /// Over the limit: what was read, and the unread rest.
    TooLarge { read: Bytes, rest: B },
    /// The body failed while being read.
    Failed(BoxError),
}

/// Reads `body` into memory unless it grows past `limit` bytes.
pub(crate) async fn collect_up_to<B>(mut body: B, limit: usize) -> Collected<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let mut read = BytesMut::new();
    let mut trailers: Option<HeaderMap> = None;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(error) => return Collected::Failed(error.into()),
        };
        match frame.into_data() {
            Ok(data) => {
                read.extend_from_slice(&data);
                if read.len() > limit {
                    return Collected::TooLarge {
                        read: read.freeze(),
                        rest: body,
                    };
                }
            }
            Err(frame) => {
                if let Ok(more) = frame.into_trailers() {
                    trailers.get_or_insert_with(HeaderMap::new).extend(more);
                }
            }
        }
    }
    Collected::Complete {
        data: read.freeze(),
        trailers,
    }
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
