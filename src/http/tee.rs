//! The first caller's response body, passed through frame by frame while a copy is kept for
//! replay.
//!
//! Nothing is buffered before the first byte: a streaming response (server-sent events, a
//! large download) reaches its caller as the handler produces it, and trailers (gRPC's
//! `grpc-status`) are passed on. Alongside, the data is copied up to the storage limit. The
//! claim stays held (and renewed) while the body streams, and is settled when it ends:
//!
//! - end of body: the copy and the trailers are recorded before the caller sees the end, so
//!   a retry sent after the response finds it. The one exception is the last data frame of a
//!   body that knows its end, when the store cannot answer at once: that frame is sent while
//!   the record is written (see `poll_frame`), and a retry arriving in between waits for it.
//!   Over the limit, the "not stored" marker is recorded instead (duplicates get 409
//!   `response-not-stored`, as for any large body);
//! - a body error: the key is released (the response was never whole), and the caller sees
//!   the broken body;
//! - dropped before its end (the client left): the rest is read in the background and
//!   recorded as above — the handler already did its work, so a retry must not run it again.
//!   It is detached work like a handler whose caller left: it takes one of the
//!   `detach_limits` slots (none free: the key is released at once) and ends with its
//!   request's lifetime, counted from the request's arrival (then the key is released).
//!   With `detach(false)` the key is released instead, as for any request dropped before its
//!   end.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

use tokio::time::Instant;

use super::{
    body::ResponseBody,
    config::Config,
    detach::{detach, spawn_or_drop},
    held_end::HeldEnd,
    policy::StatusWatch,
    replay::{self, Encoder},
};
use crate::{engine::Claim, BoxError};

type BoxFuture = super::detach::BoxFuture<()>;

/// What is kept of the response for replay, and the claim to settle with it.
pub(crate) struct Recorder {
    claim: Claim,
    status: StatusCode,
    /// The stored response so far: its status and headers.
    head: Encoder,
    config: Arc<Config>,
    copy: Kept,
    over_limit: bool,
    /// For a gRPC or gRPC-web response, where its `grpc-status`, which decides whether it
    /// is stored, is found.
    grpc_status: Option<StatusWatch>,
    /// The end of its request's lifetime: the rest of the body is not read past it, should
    /// the caller leave.
    deadline: Instant,
}

/// The body as the caller got it. A body of one frame (the common case) is kept as that
/// frame, shared rather than copied; a second frame starts a copy of both.
#[derive(Default)]
enum Kept {
    #[default]
    Empty,
    One(Bytes),
    Many(BytesMut),
}

impl Kept {
    fn len(&self) -> usize {
        match self {
            Kept::Empty => 0,
            Kept::One(frame) => frame.len(),
            Kept::Many(copy) => copy.len(),
        }
    }

    fn push(&mut self, data: &Bytes) {
        *self = match std::mem::take(self) {
            Kept::Empty => Kept::One(data.clone()),
            Kept::One(first) => {
                let mut copy = BytesMut::with_capacity(first.len() + data.len());
                copy.extend_from_slice(&first);
                copy.extend_from_slice(data);
                Kept::Many(copy)
            }
            Kept::Many(mut copy) => {
                copy.extend_from_slice(data);
                Kept::Many(copy)
            }
        }
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            Kept::Empty => &[],
            Kept::One(frame) => frame,
            Kept::Many(copy) => copy,
        }
    }
}

impl Recorder {
    /// Starts recording a response with `status` and `headers`, whose body's size is hinted
    /// by `body_hint`, for a request whose lifetime ends at `deadline`.
    pub(crate) fn new(
        claim: Claim,
        status: StatusCode,
        headers: &HeaderMap,
        body_hint: &SizeHint,
        config: Arc<Config>,
        grpc_status: Option<StatusWatch>,
        deadline: Instant,
    ) -> Self {
        // Room for the whole body when its length is known and storable; a body over the
        // limit is not stored, a longer one than hinted grows the buffer.
        let body_room = usize::try_from(body_hint.exact().unwrap_or(body_hint.lower()))
            .ok()
            .filter(|room| *room <= config.max_response_body)
            .unwrap_or(0);
        Self {
            claim,
            status,
            head: Encoder::start(status, headers, config.replay_set_cookie, body_room),
            config,
            copy: Kept::Empty,
            over_limit: false,
            grpc_status,
            deadline,
        }
    }

    fn keep(&mut self, data: &Bytes) {
        // Over the limit too: a gRPC-web status is still to be found.
        if let Some(grpc_status) = &mut self.grpc_status {
            grpc_status.data(data);
        }
        if self.over_limit {
            return;
        }
        if self.copy.len() + data.len() > self.config.max_response_body {
            tracing::warn!(key = %self.claim.key().log_id(), status = %self.status, limit = self.config.max_response_body, "response too large to store; duplicates will get 409 response-not-stored");
            self.over_limit = true;
            self.copy = Kept::Empty;
        } else {
            self.copy.push(data);
        }
    }

    /// True when the data kept so far ended a gRPC-web call: its trailer frame is complete.
    fn call_ended(&self) -> bool {
        self.grpc_status.as_ref().is_some_and(StatusWatch::ended)
    }

    /// Records the outcome (the body ended, with `trailers` if any), or releases the key when
    /// its status says the gRPC call failed with a status not to store.
    fn finish(self, trailers: Option<&HeaderMap>) -> BoxFuture {
        let is_final = |watch: &StatusWatch| watch.is_final(trailers, &self.config.is_final_grpc);
        if self
            .grpc_status
            .as_ref()
            .is_some_and(|watch| !is_final(watch))
        {
            tracing::debug!(key = %self.claim.key().log_id(), "gRPC status not final; releasing the key");
            let claim = self.claim;
            return Box::pin(async move {
                let _ = claim.release().await;
            });
        }
        let payload = if self.over_limit {
            replay::encode_not_stored(self.status)
        } else {
            self.head.finish(trailers, self.copy.as_slice())
        };
        // A failed write is retried and logged by the engine; the caller still gets the real
        // response.
        // Only the claim is moved in: the rest of the recorder is dropped now rather than
        // carried in the boxed future.
        let claim = self.claim;
        Box::pin(async move {
            let _ = claim.complete(payload).await;
        })
    }

    fn release(self, error: &BoxError) -> BoxFuture {
        tracing::error!(key = %self.claim.key().log_id(), error = %error, "response body failed; releasing the key");
        Box::pin(async move {
            let _ = self.claim.release().await;
        })
    }
}

/// The tee itself: see the module docs.
pub(crate) struct Tee {
    inner: ResponseBody,
    recorder: Option<Recorder>,
    /// The end of the body, held back while its outcome is recorded.
    end: HeldEnd<()>,
}

impl Tee {
    pub(crate) fn new(inner: ResponseBody, recorder: Recorder) -> Self {
        Self {
            inner,
            recorder: Some(recorder),
            end: HeldEnd::new(),
        }
    }
}

impl Body for Tee {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if let Some(((), frame)) = std::task::ready!(this.end.poll(cx)) {
                return Poll::Ready(frame.map(Ok));
            }
            if this.end.ended() {
                return Poll::Ready(None);
            }
            match std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        let Some(recorder) = &mut this.recorder else {
                            return Poll::Ready(Some(Ok(frame)));
                        };
                        recorder.keep(data);
                        if recorder.call_ended() {
                            // A gRPC-web call's status, sent as data: recorded before it is
                            // handed on, as trailers are.
                            let recorder = this.recorder.take().expect("checked above");
                            this.end.hold(recorder.finish(None), Some(frame));
                            continue;
                        }
                        if !this.inner.is_end_stream() {
                            return Poll::Ready(Some(Ok(frame)));
                        }
                        // The last frame of a body that knows its end (a `Full` body, a known
                        // length): hyper drops such a body after writing it without asking for
                        // more. Record now: a store that answers at once (the memory store) has
                        // the outcome before the frame goes out. One that must wait (a round
                        // trip) gets the frame sent first: held back, hyper would flush the head
                        // alone and the body later, which Nagle's algorithm and delayed ACKs
                        // stall for 40 ms. Its record is then finished beside the response (in
                        // a task, if hyper drops the body), and a retry arriving before that
                        // waits for it.
                        let recorder = this.recorder.take().expect("checked above");
                        let mut settle = recorder.finish(None);
                        if settle.as_mut().poll(cx).is_pending() {
                            this.end.hold(settle, None);
                        } else {
                            this.end.end();
                        }
                        return Poll::Ready(Some(Ok(frame)));
                    }
                    let Some(recorder) = this.recorder.take() else {
                        return Poll::Ready(Some(Ok(frame)));
                    };
                    // Trailers end the body: record, then hand them on.
                    let settle = recorder.finish(frame.trailers_ref());
                    this.end.hold(settle, Some(frame));
                }
                Some(Err(error)) => {
                    this.end.end();
                    if let Some(recorder) = this.recorder.take() {
                        // The caller learns of the error now; the release needs no waiting.
                        spawn_or_drop(recorder.release(&error));
                    }
                    return Poll::Ready(Some(Err(error)));
                }
                None => match this.recorder.take() {
                    Some(recorder) => this.end.hold(recorder.finish(None), None),
                    None => this.end.end(),
                },
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.end.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Tee {
    fn drop(&mut self) {
        if let Some(settle) = self.end.take_settling() {
            spawn_or_drop(settle);
            return;
        }
        let Some(recorder) = self.recorder.take() else {
            return;
        };
        if !recorder.config.detach {
            // `detach(false)`: a caller that leaves gives the key up.
            spawn_or_drop(Box::pin(async move {
                let _ = recorder.claim.release().await;
            }));
            return;
        }
        // The client left mid-body: read the rest so the outcome is recorded, under the
        // limits of any detached work (a slot, the request's lifetime); without a slot, or
        // past the lifetime, the claim is dropped, which releases the key.
        let (slots, deadline) = (recorder.config.detached.clone(), recorder.deadline);
        let inner = std::mem::replace(&mut self.inner, super::body::full(Bytes::new()));
        detach(Box::pin(drain(inner, recorder)), &slots, deadline);
    }
}

async fn drain(mut body: ResponseBody, mut recorder: Recorder) {
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => match frame.into_data() {
                Ok(data) => recorder.keep(&data),
                Err(frame) => return recorder.finish(frame.trailers_ref()).await,
            },
            Err(error) => return recorder.release(&error).await,
        }
    }
    recorder.finish(None).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kept_body_is_every_frame_in_order() {
        let mut kept = Kept::default();
        assert_eq!(kept.as_slice(), b"");
        let first = Bytes::from_static(b"one,");
        kept.push(&first);
        // One frame is shared, not copied.
        assert_eq!(kept.as_slice().as_ptr(), first.as_ptr());
        for frame in [&b"two,"[..], b"", b"three"] {
            kept.push(&Bytes::copy_from_slice(frame));
        }
        assert_eq!(kept.as_slice(), b"one,two,three");
        assert_eq!(kept.len(), 13);
    }
}
