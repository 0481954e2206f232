//! The HTTP face of the transactional mode: lend the transaction to the inner service, then
//! commit the response with it, or roll everything back. The database type is erased in
//! `tx_mode`.

use std::{panic::AssertUnwindSafe, sync::Arc, time::Duration};

use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::{
    answer::{rejection_for, render, replay as replay_response},
    body::{self, ResponseBody},
    collect::{collect_up_to, Collected, Prefixed},
    commit_at_end::CommitAtEnd,
    config::Config,
    grpc::Protocol,
    policy::{self, Outcome, StatusWatch},
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
    async fn answer(self, config: &Config, protocol: Protocol) -> Response<ResponseBody> {
        let retry_after = config.engine.retry_after_delay();
        match self.mode.wait_for(self.key, self.fingerprint).await {
            Ok(HttpBegin::Replay(payload)) => replay_response(config, protocol, payload),
            Ok(HttpBegin::Run(owner)) => {
                owner.rollback().await;
                render(config, protocol, Rejection::NotCommitted { retry_after })
            }
            Err(error) => render(config, protocol, rejection_for(error)),
        }
    }
}

/// Rolls a failed operation back. If the database had rolled its transaction back under the
/// handler (a deadlock's victim; on Galera, a brute-force abort by a write set of the same key
/// that certified first), the handler's failure is an echo of that, not the request's outcome:
/// a keyed request is then answered as a duplicate (the winner's outcome, or `not-committed`
/// when nobody holds the key), like a commit that lost its key.
async fn lost_under_handler(
    owner: Box<dyn HttpOwner>,
    duplicate: Option<AsDuplicate>,
) -> Option<AsDuplicate> {
    let Some(duplicate) = duplicate else {
        owner.rollback().await;
        return None;
    };
    if owner.rollback_lost().await {
        tracing::debug!(key = %duplicate.key.log_id(), "the database rolled the transaction back under the handler; answering as a duplicate");
        return Some(duplicate);
    }
    None
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
    let protocol = Protocol::of(request.headers());
    // What the rare warnings below name (the request's span is DEBUG, so it may not show).
    let log_id = duplicate.as_ref().map(|d| d.key.clone());
    let key = || {
        log_id
            .as_ref()
            .map_or_else(|| "(unkeyed)".to_owned(), StoreKey::log_id)
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
            return Ok(render(&config, protocol, Rejection::HandlerPanicked));
        }
    };
    let outcome = policy::outcome(&response, &config.is_final, &config.is_final_grpc);
    let keyed = duplicate.is_some();
    if outcome == Outcome::NotFinal {
        // Not an outcome: its writes go too, so a retry starts from a clean slate.
        tracing::debug!(status = %response.status(), "outcome not final; rolling back");
        if let Some(duplicate) = lost_under_handler(owner, duplicate).await {
            return Ok(duplicate.answer(&config, protocol).await);
        }
        return Ok(response.map(body::boxed));
    }
    let (parts, response_body) = response.into_parts();
    // The body is read before the commit: the client may only see what committed.
    let (payload, body) = match collect_up_to(Box::pin(response_body), config.max_response_body)
        .await
    {
        Collected::Complete { data, trailers }
            if matches!(outcome, Outcome::ByStatus(at)
                if !policy::body_final(at, &data, trailers.as_ref(), &config.is_final_grpc)) =>
        {
            // A gRPC call that failed with a status not to store: its writes go too.
            tracing::debug!("gRPC status not final; rolling back");
            if let Some(duplicate) = lost_under_handler(owner, duplicate).await {
                return Ok(duplicate.answer(&config, protocol).await);
            }
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
            let payload = replay::encode_not_stored(parts.status);
            let body = body::boxed(Prefixed::new(read, rest));
            if let Outcome::ByStatus(at) = outcome {
                // Its status is still to come: the commit waits for it, the client's view of
                // the status waits for the commit.
                let status = StatusWatch::new(at);
                let body = CommitAtEnd::new(body, owner, status, payload, config, keyed, key());
                return Ok(Response::from_parts(parts, body::boxed(body)));
            }
            (payload, body)
        }
        Collected::Failed(error) => {
            tracing::error!(key = %key(), error = %error, "response body failed; rolling back");
            owner.rollback().await;
            return Ok(render(&config, protocol, Rejection::ResponseBodyFailed));
        }
    };
    let error = match owner.commit(payload).await {
        Ok(()) => return Ok(Response::from_parts(parts, body)),
        Err(error) => error,
    };
    if let (CommitError::KeyTaken, Some(duplicate)) = (&error, duplicate) {
        return Ok(duplicate.answer(&config, protocol).await);
    }
    let retry_after = config.engine.retry_after_delay();
    let rejection = commit_failed(&error, &key(), keyed, retry_after);
    Ok(render(&config, protocol, rejection))
}

/// The answer for a commit that failed with `error` (logged, naming `key`), for a request
/// with a key or without (`keyed`), when it cannot be answered as a duplicate.
pub(super) fn commit_failed(
    error: &CommitError,
    key: &str,
    keyed: bool,
    retry_after: Duration,
) -> Rejection {
    match error {
        CommitError::OutcomeUnknown(_) => {
            tracing::error!(key = %key, error = %error, "connection lost during the commit; the handler's writes may or may not have committed");
            match keyed {
                true => Rejection::OutcomeUnknown { retry_after },
                // Nothing records an unkeyed request: "retry with the same key" would be false.
                false => Rejection::OutcomeUnknownWithoutKey,
            }
        }
        CommitError::StillBorrowed(_) => {
            tracing::error!(key = %key, error = %error, "commit failed; the handler's writes were rolled back");
            Rejection::TransactionHeld
        }
        // The key taken by another request (unkeyed work claims none; a stream already sent
        // part of its answer), or a refused commit: nothing of it persists.
        _ => {
            tracing::error!(key = %key, error = %error, "commit failed; the handler's writes were rolled back");
            Rejection::NotCommitted { retry_after }
        }
    }
}
