//! The HTTP face of the transactional mode: lend the transaction to the inner service, then
//! commit the response with it, or roll everything back. The database type is erased in
//! `tx_mode`.

use std::{panic::AssertUnwindSafe, sync::Arc};

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
    grpc,
    policy::{self, Outcome},
    rejection::Rejection,
    replay,
    tx_mode::{HttpBegin, HttpOwner, SharedTxMode},
};
use crate::{
    record::{Fingerprint, StoreKey},
    transactional::CommitError,
    BoxError,
};

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
    async fn answer(self, config: &Config, grpc: bool) -> Response<ResponseBody> {
        let retry_after = config.engine.retry_after_delay();
        match self.mode.wait_for(self.key, self.fingerprint).await {
            Ok(HttpBegin::Replay(payload)) => replay_response(config, grpc, payload),
            Ok(HttpBegin::Run(owner)) => {
                owner.rollback().await;
                render(config, grpc, Rejection::NotCommitted { retry_after })
            }
            Err(error) => render(config, grpc, rejection_for(error)),
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
    let grpc = grpc::is_grpc(request.headers());
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
            return Ok(render(&config, grpc, Rejection::HandlerPanicked));
        }
    };
    let outcome = policy::outcome(&response, &config.is_final, &config.is_final_grpc);
    if outcome == Outcome::NotFinal {
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
        Collected::Complete { data, trailers }
            if outcome == Outcome::ByTrailers
                && !policy::trailers_final(trailers.as_ref(), &config.is_final_grpc) =>
        {
            // A gRPC call that failed with a status not to store: its writes go too.
            tracing::debug!("gRPC status not final; rolling back");
            owner.rollback().await;
            let body = match trailers {
                Some(trailers) => body::with_trailers(data, trailers),
                None => body::full(data),
            };
            return Ok(Response::from_parts(parts, body));
        }
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
            return Ok(render(&config, grpc, Rejection::ResponseBodyFailed));
        }
    };
    let retry_after = config.engine.retry_after_delay();
    match owner.commit(payload).await {
        Ok(()) => Ok(Response::from_parts(parts, body)),
        Err(CommitError::KeyTaken) => Ok(match duplicate {
            Some(duplicate) => duplicate.answer(&config, grpc).await,
            // Unkeyed work claims no key, so no other request can record it first.
            None => render(&config, grpc, Rejection::NotCommitted { retry_after }),
        }),
        Err(error @ CommitError::OutcomeUnknown(_)) => {
            tracing::error!(key = %key(), error = %error, "connection lost during the commit; the handler's writes may or may not have committed");
            let rejection = match duplicate {
                Some(_) => Rejection::OutcomeUnknown { retry_after },
                // Nothing records an unkeyed request: "retry with the same key" would be false.
                None => Rejection::OutcomeUnknownWithoutKey,
            };
            Ok(render(&config, grpc, rejection))
        }
        Err(error) => {
            tracing::error!(key = %key(), error = %error, "commit failed; the handler's writes were rolled back");
            let rejection = match error {
                CommitError::StillBorrowed(_) => Rejection::TransactionHeld,
                _ => Rejection::NotCommitted { retry_after },
            };
            Ok(render(&config, grpc, rejection))
        }
    }
}
