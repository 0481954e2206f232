//! The end of a response body, held back while what the body decided settles: its outcome
//! being recorded (the tee), its transaction committing (a large transactional gRPC stream).
//! The frame that ends the body (trailers, a gRPC-web trailer frame, or the end itself)
//! reaches the caller only once that work is done, so a caller who saw the end of a call
//! finds its outcome settled.

use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Frame;

use super::detach::BoxFuture;

/// The work that settles a body's outcome, with its result.
pub(crate) type Settle<T> = BoxFuture<T>;

/// See the module docs.
pub(crate) struct HeldEnd<T> {
    /// The work under way, and the frame to hand on after it (`None`: the end of the body).
    settling: Option<(Settle<T>, Option<Frame<Bytes>>)>,
    /// The body has nothing more to give (once `settling` is done).
    ended: bool,
}

impl<T> HeldEnd<T> {
    pub(crate) fn new() -> Self {
        Self {
            settling: None,
            ended: false,
        }
    }

    /// Holds `frame` back (`None`: the end of the body) until `settle` is done.
    pub(crate) fn hold(&mut self, settle: Settle<T>, frame: Option<Frame<Bytes>>) {
        self.settling = Some((settle, frame));
    }

    /// Ends the body: nothing is read from it any more.
    pub(crate) fn end(&mut self) {
        self.ended = true;
    }

    /// `Ready(Some(..))` once the held work is done: its result and the frame to hand on,
    /// after which the body has ended. `Ready(None)` when nothing is held; `Pending` while
    /// the work runs.
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Option<(T, Option<Frame<Bytes>>)>> {
        let Some((settle, _)) = &mut self.settling else {
            return Poll::Ready(None);
        };
        let settled = std::task::ready!(settle.as_mut().poll(cx));
        let (_, frame) = self.settling.take().expect("checked above");
        self.ended = true;
        Poll::Ready(Some((settled, frame)))
    }

    /// True once the body has ended and nothing is held: nothing more to read or hand on.
    pub(crate) fn ended(&self) -> bool {
        self.ended
    }

    /// [`http_body::Body::is_end_stream`] for the body holding this end.
    pub(crate) fn is_end_stream(&self) -> bool {
        self.ended && self.settling.is_none()
    }

    /// The work under way, for a body dropped before it was done: it must still finish.
    pub(crate) fn take_settling(&mut self) -> Option<Settle<T>> {
        self.settling.take().map(|(settle, _)| settle)
    }
}
