//! The HTTP face of the transactional mode: lend the transaction to the inner service, then
//! commit the response with it, or roll everything back.
//!
//! The database type is erased here ([`TxMode`], [`HttpOwner`]) so that the layer and its
//! service stay free of a database type parameter.

use std::{panic::AssertUnwindSafe, sync::Arc};

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::{
    answer::{rejection_for, render, replay as replay_response},
    body::{self, ResponseBody},
    collect::{collect_up_to, Collected, Prefixed},
    config::Config,
    policy::DoNotStore,
    rejection::Rejection,
    replay,
};
use crate::{
    engine::EngineError,
    record::{Fingerprint, StoreKey},
    transactional::{CommitError, Transactional, TransactionalStore, TxBegin, TxOwner},
    BoxError,
};

/// What the layer needs of [`Transactional`], whatever its database.
#[async_trait]
pub(crate) trait TxMode: Send + Sync {
    /// See [`Transactional::try_begin`]: `None` when the caller must wait.
    async fn try_begin(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
    ) -> Result<Option<HttpBegin>, EngineError>;
    /// See [`Transactional::wait_for`].
    async fn wait_for(
        &self,
        key: StoreKey,
        fingerprint: Fingerprint,
    ) -> Result<HttpBegin, EngineError>;
    fn begin_unkeyed(&self) -> Box<dyn HttpOwner>;
}

pub(crate) enum HttpBegin {
    Run(Box<dyn HttpOwner>),
    Replay(Bytes),
}

/// A [`TxOwner`] without its database type.
#[async_trait]
pub(crate) trait HttpOwner: Send {
    /// Puts the transaction into the request's extensions.
    fn lend(&self, extensions: &mut http::Extensions);
    async fn commit(self: Box<Self>, payload: Bytes) -> Result<(), CommitError>;
    async fn rollback(self: Box<Self>);
}

impl<DB: sqlx::Database> From<TxBegin<DB>> for HttpBegin {
    fn from(begin: TxBegin<DB>) -> Self {
        match begin {
            TxBegin::Run(owner) => HttpBegin::Run(Box::new(owner)),
            TxBegin::Replay(payload) => HttpBegin::Replay(payload),
        }
    }
}

#[async_trait]
impl<S: TransactionalStore> TxMode for Transactional<S> {
    async fn try_begin(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
    ) -> Result<Option<HttpBegin>, EngineError> {
        Ok(Transactional::try_begin(self, key, fingerprint)
            .await?
            .map(HttpBegin::from))
    }

    async fn wait_for(
        &self,
        key: StoreKey,
        fingerprint: Fingerprint,
    ) -> Result<HttpBegin, EngineError> {
        Transactional::wait_for(self, key, fingerprint)
            .await
            .map(HttpBegin::from)
    }

    fn begin_unkeyed(&self) -> Box<dyn HttpOwner> {
        Box::new(Transactional::begin_unkeyed(self))
    }
}

#[async_trait]
impl<DB: sqlx::Database> HttpOwner for TxOwner<DB> {
    fn lend(&self, extensions: &mut http::Extensions) {
        extensions.insert(self.transaction().clone());
    }

    async fn commit(self: Box<Self>, payload: Bytes) -> Result<(), CommitError> {
        TxOwner::commit(*self, payload).await
    }

    async fn rollback(self: Box<Self>) {
        TxOwner::rollback(*self).await
    }
}

pub(crate) type SharedTxMode = Arc<dyn TxMode>;

/// A keyed request, for answering it as a duplicate when its commit finds that another
/// request recorded the key first ([`CommitError::KeyTaken`]).
pub(crate) struct AsDuplicate {
    pub(crate) mode: SharedTxMode,
    pub(crate) key: StoreKey,
    pub(crate) fingerprint: Fingerprint,
}

impl AsDuplicate {
    /// Waits for the recorded outcome and replays it, like any duplicate. Should the key be
    /// free again by then (the record expired at once), the client is told to retry: its
    /// request was rolled back and cannot run a second time here.
    async fn answer(self, config: &Config) -> Response<ResponseBody> {
        let retry_after = config.engine.retry_after_delay();
        match self.mode.wait_for(self.key, self.fingerprint).await {
            Ok(HttpBegin::Replay(payload)) => replay_response(config, payload),
            Ok(HttpBegin::Run(owner)) => {
                owner.rollback().await;
                render(config, Rejection::NotCommitted { retry_after })
            }
            Err(error) => render(config, rejection_for(error)),
        }
    }
}

/// Runs the inner service on the owner's transaction and commits its response with it. The
/// client gets the handler's answer only if that commit succeeded; if another request
/// recorded the key first, it gets that request's answer (`duplicate`).
pub(crate) async fn execute<S, ReqBody, ResBody>(
    mut inner: S,
    owner: Box<dyn HttpOwner>,
    mut request: Request<ReqBody>,
    config: Arc<Config>,
    duplicate: Option<AsDuplicate>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    owner.lend(request.extensions_mut());
    // What the rare warnings below name (the request's span is DEBUG, so it may not show).
    let key = || {
        duplicate
            .as_ref()
            .map_or_else(|| "(unkeyed)".to_owned(), |d| d.key.log_id())
    };
    let response = match AssertUnwindSafe(inner.call(request)).catch_unwind().await {
        Ok(Ok(response)) => response,
        Ok(Err(error)) => {
            owner.rollback().await;
            return Err(error);
        }
        Err(_panic) => {
            tracing::error!(key = %key(), "inner service panicked; rolling its transaction back");
            owner.rollback().await;
            return Ok(render(&config, Rejection::HandlerPanicked));
        }
    };
    if response.extensions().get::<DoNotStore>().is_some() || !(config.is_final)(response.status())
    {
        // Not an outcome: its writes go too, so a retry starts from a clean slate.
        tracing::debug!(status = %response.status(), "outcome not final; rolling back");
        owner.rollback().await;
        return Ok(response.map(body::boxed));
    }
    let (parts, response_body) = response.into_parts();
    // The body is read before the commit: the client may only see what committed.
    let (payload, body) = match collect_up_to(Box::pin(response_body), config.max_response_body)
        .await
    {
        Collected::Complete { data, trailers } => (
            replay::encode_with_trailers(
                parts.status,
                &parts.headers,
                trailers.as_ref(),
                &data,
                config.replay_set_cookie,
            ),
            match trailers {
                Some(trailers) => body::with_trailers(data, trailers),
                None => body::full(data),
            },
        ),
        Collected::TooLarge { read, rest } => {
            tracing::warn!(key = %key(), status = %parts.status, limit = config.max_response_body, "response too large to store; duplicates will get 409 response-not-stored");
            (
                replay::encode_not_stored(parts.status),
                body::boxed(Prefixed::new(read, rest)),
            )
        }
        Collected::Failed(error) => {
            tracing::error!(key = %key(), error = %error, "response body failed; rolling back");
            owner.rollback().await;
            return Ok(render(&config, Rejection::ResponseBodyFailed));
        }
    };
    let retry_after = config.engine.retry_after_delay();
    match owner.commit(payload).await {
        Ok(()) => Ok(Response::from_parts(parts, body)),
        Err(CommitError::KeyTaken) => Ok(match duplicate {
            Some(duplicate) => duplicate.answer(&config).await,
            // Unkeyed work claims no key, so no other request can record it first.
            None => render(&config, Rejection::NotCommitted { retry_after }),
        }),
        Err(error) => {
            tracing::error!(key = %key(), error = %error, "commit failed; the handler's writes were rolled back");
            let rejection = match error {
                CommitError::StillBorrowed(_) => Rejection::TransactionHeld,
                _ => Rejection::NotCommitted { retry_after },
            };
            Ok(render(&config, rejection))
        }
    }
}
