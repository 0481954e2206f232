//! The body of a transactional gRPC or gRPC-web response too large to hold in memory before
//! its commit. Its messages stream to the client as they come, but the call's status (its
//! trailers, or its gRPC-web trailer frame) is held back until the transaction has committed
//! (a status to store) or rolled back (a status a retry may cure): the client never sees the
//! status of a call whose writes did not persist.
//!
//! A commit that fails replaces the trailers with the failure's status (`UNAVAILABLE`, ...);
//! on gRPC-web, whose status is a data frame, the body ends with an error instead, so the
//! client sees a broken call. A client that leaves before the status rolls the transaction
//! back: it never learned the outcome, and its retry runs again.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

use super::{
    body::ResponseBody,
    config::Config,
    detach::spawn_or_drop,
    grpc,
    held_end::{HeldEnd, Settle},
    policy::StatusWatch,
    rejection::Rejection,
    transactional::commit_failed,
    tx_mode::HttpOwner,
};
use crate::BoxError;

/// The commit or rollback under way: `Some` rejection when the commit failed.
type Settling = Settle<Option<Rejection>>;

/// See the module docs.
pub(crate) struct CommitAtEnd {
    inner: ResponseBody,
    /// The transaction, until the status is known.
    owner: Option<Box<dyn HttpOwner>>,
    status: StatusWatch,
    /// What commits with a stored status: the "not stored" marker, the body being over the
    /// storage limit.
    payload: Bytes,
    config: Arc<Config>,
    /// Whether the call has a key (an unkeyed one's failed commit is answered differently).
    keyed: bool,
    /// What the logs name.
    key: String,
    /// The frame that ends the call, held back while the transaction commits or rolls back.
    end: HeldEnd<Option<Rejection>>,
}

impl CommitAtEnd {
    pub(crate) fn new(
        inner: ResponseBody,
        owner: Box<dyn HttpOwner>,
        status: StatusWatch,
        payload: Bytes,
        config: Arc<Config>,
        keyed: bool,
        key: String,
    ) -> Self {
        Self {
            inner,
            owner: Some(owner),
            status,
            payload,
            config,
            keyed,
            key,
            end: HeldEnd::new(),
        }
    }

    /// The call ended (with `trailers`, if any): commit or roll back, then hand on `frame`.
    fn settle(&mut self, trailers: Option<&HeaderMap>, frame: Option<Frame<Bytes>>) {
        let owner = self.owner.take().expect("settled once");
        let settling: Settling = if self.status.is_final(trailers, &self.config.is_final_grpc) {
            let payload = self.payload.clone();
            let (keyed, key) = (self.keyed, self.key.clone());
            let retry_after = self.config.engine.retry_after_delay();
            Box::pin(async move {
                let error = owner.commit(payload).await.err()?;
                Some(commit_failed(&error, &key, keyed, retry_after))
            })
        } else {
            tracing::debug!(key = %self.key, "gRPC status not final; rolling back");
            Box::pin(async move {
                owner.rollback().await;
                None
            })
        };
        self.end.hold(settling, frame);
    }

    /// What the client gets instead of the status of a call whose commit failed.
    fn failed(
        rejection: Rejection,
        frame: Option<Frame<Bytes>>,
    ) -> Option<Result<Frame<Bytes>, BoxError>> {
        crate::metrics::http_rejection(&rejection);
        Some(match frame {
            Some(frame) if frame.is_trailers() => Ok(Frame::trailers(grpc::status_headers(
                &rejection,
                HeaderMap::new(),
            ))),
            // A gRPC-web status is data: end the call broken rather than with it.
            _ => Err(Box::new(rejection)),
        })
    }
}

impl Body for CommitAtEnd {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if let Some((failed, frame)) = std::task::ready!(this.end.poll(cx)) {
                return Poll::Ready(match failed {
                    None => frame.map(Ok),
                    Some(rejection) => Self::failed(rejection, frame),
                });
            }
            if this.end.ended() {
                return Poll::Ready(None);
            }
            match std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.data_ref() {
                    Some(data) => {
                        this.status.data(data);
                        if !this.status.ended() {
                            return Poll::Ready(Some(Ok(frame)));
                        }
                        // The gRPC-web trailer frame: the call's status.
                        this.settle(None, Some(frame));
                    }
                    None => {
                        let trailers = frame.trailers_ref().cloned();
                        this.settle(trailers.as_ref(), Some(frame));
                    }
                },
                Some(Err(error)) => {
                    tracing::error!(key = %this.key, error = %error, "response body failed; rolling back");
                    this.end.end();
                    if let Some(owner) = this.owner.take() {
                        spawn_or_drop(Box::pin(owner.rollback()));
                    }
                    return Poll::Ready(Some(Err(error)));
                }
                None => this.settle(None, None),
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

impl Drop for CommitAtEnd {
    fn drop(&mut self) {
        if let Some(settling) = self.end.take_settling() {
            // Decided already: let the commit or rollback finish.
            spawn_or_drop(Box::pin(async move {
                settling.await;
            }));
        } else if let Some(owner) = self.owner.take() {
            tracing::debug!(key = %self.key, "client left before the call's status; rolling back");
            spawn_or_drop(Box::pin(owner.rollback()));
        }
    }
}
