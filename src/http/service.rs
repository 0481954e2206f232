//! [`IdempotencyService`]: reads the key, fingerprints the request, asks the engine, and runs,
//! replays or rejects.

use std::{
    future::Future,
    panic::AssertUnwindSafe,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response};
use http_body::Body;
use tokio::time::Instant;
use tower_layer::Layer;
use tower_service::Service;
use tracing::Instrument;

use super::{
    answer::{rejection_for, render, replay},
    body::{self, ResponseBody},
    bounds::{IncomingBody, OutgoingBody, Wrapped},
    config::Config,
    detach::{BoxFuture, DetachOnDrop},
    fingerprint::fingerprint,
    grpc::{self, Protocol},
    key::parse_key,
    layer::IdempotencyLayer,
    message_key,
    policy::{self, Outcome, StatusWatch},
    rejection::Rejection,
    request_body::read_body,
    scope,
    tee::{Recorder, Tee},
};
#[cfg(feature = "sqlx")]
use super::{
    transactional,
    tx_mode::{HttpBegin, SharedTxMode},
};
use crate::{
    engine::{Begin, Claim},
    record::StoreKey,
    BoxError,
};

/// The service [`IdempotencyLayer`] wraps around an inner service.
///
/// Cheap to clone (axum clones it for every request): the inner service and one `Arc`.
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> IdempotencyService<S> {
    /// Wraps `inner` with what `layer` was configured with (the same as `layer.layer(inner)`).
    pub fn new(inner: S, layer: &IdempotencyLayer) -> Self {
        Self {
            inner,
            config: layer.config().clone(),
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes `self`, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

// Here rather than in layer.rs: the service depends on the layer's configuration, never the
// other way round.
impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, self)
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .field("engine", &self.config.engine)
            .field("enabled", &self.config.enabled)
            .finish_non_exhaustive()
    }
}

pin_project_lite::pin_project! {
    /// The response future of [`IdempotencyService`].
    pub struct ResponseFuture<F, E> {
        #[pin]
        state: State<F, E>,
    }
}

pin_project_lite::pin_project! {
    #[project = Projected]
    enum State<F, E> {
        // Not protected (method not covered, no key, layer disabled): the inner future.
        Passthrough { #[pin] future: F },
        // Protected: claim, run or replay.
        Protected { future: BoxFuture<Result<Response<ResponseBody>, E>> },
        // Held inline rather than boxed around the work's own box: one allocation fewer.
        Detachable { future: DetachOnDrop<Result<Response<ResponseBody>, E>> },
        // Rejected before anything ran.
        Rejected { response: Option<Response<ResponseBody>> },
    }
}

impl<F, E> ResponseFuture<F, E> {
    fn passthrough(future: F) -> Self {
        Self {
            state: State::Passthrough { future },
        }
    }

    /// The protected work of a request that `arrived` then, detachable when the layer says
    /// so: a client hanging up at any point (the claim in flight, the handler running, the
    /// outcome being written) must not leave a claim behind that nobody completes or
    /// releases. The whole request's work is detached rather than only what follows the
    /// claim, so its state is in one allocation (and the detaching wrapper in a small one)
    /// instead of boxes inside boxes.
    fn protected(
        future: BoxFuture<Result<Response<ResponseBody>, E>>,
        config: &Config,
        arrived: Instant,
    ) -> Self
    where
        E: Send + 'static,
    {
        let state = if config.detach {
            let deadline = arrived + config.max_handler_lifetime;
            State::Detachable {
                future: DetachOnDrop::new(future, config.detached.clone(), deadline),
            }
        } else {
            State::Protected { future }
        };
        Self { state }
    }

    fn rejected(config: &Config, protocol: Protocol, rejection: Rejection) -> Self {
        Self {
            state: State::Rejected {
                response: Some(render(config, protocol, rejection)),
            },
        }
    }
}

impl<F, E, B> Future for ResponseFuture<F, E>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Output = Result<Response<ResponseBody>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            Projected::Passthrough { future } => future.poll(cx).map_ok(|r| r.map(body::boxed)),
            Projected::Protected { future } => future.as_mut().poll(cx),
            Projected::Detachable { future } => Pin::new(future).poll(cx),
            Projected::Rejected { response } => Poll::Ready(Ok(response
                .take()
                .expect("ResponseFuture polled after completion"))),
        }
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for IdempotencyService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let config = &self.config;
        if !config.enabled || !config.methods.contains(request.method()) {
            return ResponseFuture::passthrough(self.inner.call(request));
        }
        let key = match parse_key(request.headers(), &config.header) {
            Ok(Some(key)) => key,
            Ok(None) => return without_key(self, request),
            Err(invalid) => {
                let protocol = Protocol::of(request.headers());
                return ResponseFuture::rejected(config, protocol, Rejection::InvalidKey(invalid));
            }
        };
        let inner = take_ready(&mut self.inner);
        // One clock reading per request: the handler's lifetime, the rest of its response
        // body's and a gRPC call's deadline all count from here.
        let arrived = Instant::now();
        let work = protect(inner, config.clone(), key, request, arrived);
        ResponseFuture::protected(work, config, arrived)
    }
}

/// A request that sent no key header. A gRPC call to a method keyed by its message reads the
/// key from it; otherwise there is nothing to deduplicate on: it runs unprotected (rather than
/// under some shared key) where the key is optional, and is refused where it is required.
fn without_key<S, ReqBody, ResBody>(
    service: &mut IdempotencyService<S>,
    request: Request<ReqBody>,
) -> ResponseFuture<S::Future, S::Error>
where
    S: Wrapped<ReqBody, ResBody>,
    ReqBody: IncomingBody,
    ResBody: OutgoingBody,
{
    let config = &service.config;
    if let Some(extract) = message_key::extractor_for(config, &request) {
        let inner = take_ready(&mut service.inner);
        let arrived = Instant::now();
        let work =
            message_key::protect_by_message(inner, config.clone(), extract, request, arrived);
        return ResponseFuture::protected(work, config, arrived);
    }
    if config.key_required {
        let protocol = Protocol::of(request.headers());
        return ResponseFuture::rejected(config, protocol, Rejection::MissingKey);
    }
    #[cfg(feature = "sqlx")]
    if let Some(mode) = config.transactional.clone() {
        let inner = take_ready(&mut service.inner);
        let work = Box::pin(unkeyed(inner, mode, request, config.clone()));
        return ResponseFuture::protected(work, config, Instant::now());
    }
    ResponseFuture::passthrough(service.inner.call(request))
}

/// Takes the service that was driven to readiness, leaving a fresh clone in its place.
fn take_ready<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}

/// A keyed request's work: read the body, claim, then run or replay. The part that needs no
/// waiting runs now, so the future returned (boxed, as the response future keeps it) carries
/// the request's parts once, not again as an argument of an `async fn`. `arrived`: when the
/// layer got the request, which its time limits count from.
pub(super) fn protect<S, ReqBody, ResBody>(
    inner: S,
    config: Arc<Config>,
    key: String,
    request: Request<ReqBody>,
    arrived: Instant,
) -> BoxFuture<Result<Response<ResponseBody>, S::Error>>
where
    S: Wrapped<ReqBody, ResBody>,
    ReqBody: IncomingBody,
    ResBody: OutgoingBody,
{
    let (parts, body) = request.into_parts();
    let protocol = Protocol::of(&parts.headers);
    let scope = match (config.scope)(&parts) {
        Some(scope) => scope,
        None if config.anonymous_scope => scope::ANONYMOUS.to_owned(),
        None => {
            let answer = render(&config, protocol, Rejection::MissingIdentity);
            return Box::pin(std::future::ready(Ok(answer)));
        }
    };
    let key = StoreKey::new(scope, key);
    // DEBUG, as tower-http's `TraceLayer` spans are: at INFO a formatting subscriber builds
    // and formats every request's span, about a microsecond each. The engine's and the tee's
    // warnings and errors name their key themselves.
    let span =
        tracing::debug_span!("idempotency", key = %key.lazy_log_id(), method = %parts.method);
    let work = async move {
        let body = match read_body(&parts.headers, body, config.max_request_body).await {
            Ok(body) => body,
            Err(rejection) => return Ok(render(&config, protocol, rejection)),
        };
        // A client stream has no one request to fingerprint and replay.
        if protocol.is_grpc() && grpc::request_message(protocol, &body).is_none() {
            return Ok(render(&config, protocol, Rejection::NotUnary));
        }
        let fingerprint = fingerprint(&parts, &config.fingerprint_headers, &body);
        #[cfg(feature = "sqlx")]
        if let Some(mode) = config.transactional.clone() {
            // Boxed: the transactional states stay out of the separate mode's future.
            let claim_and_run: BoxFuture<_> = Box::pin(async move {
                let (owner, inner) = match mode.try_begin(&key, &fingerprint).await {
                    Ok(Some(HttpBegin::Run(owner))) => (owner, inner),
                    Ok(Some(HttpBegin::Replay(payload))) => {
                        return Ok(replay(&config, protocol, payload))
                    }
                    Ok(None) => {
                        // As in the separate mode: a waiting duplicate holds no readied service.
                        let unreadied = inner.clone();
                        drop(inner);
                        let waited = Box::pin(mode.wait_for(key.clone(), fingerprint));
                        let deadline = call_deadline(protocol, &parts, arrived);
                        match within(deadline, waited).await {
                            None => {
                                return Ok(render(&config, protocol, Rejection::DeadlineExceeded))
                            }
                            Some(Ok(HttpBegin::Run(owner))) => match ready(unreadied).await {
                                Ok(inner) => (owner, inner),
                                Err(error) => {
                                    owner.rollback().await;
                                    return Err(error);
                                }
                            },
                            Some(Ok(HttpBegin::Replay(payload))) => {
                                return Ok(replay(&config, protocol, payload))
                            }
                            Some(Err(error)) => {
                                return Ok(render(&config, protocol, rejection_for(error)))
                            }
                        }
                    }
                    Err(error) => return Ok(render(&config, protocol, rejection_for(error))),
                };
                let request = Request::from_parts(parts, ReqBody::from(body));
                let duplicate = transactional::AsDuplicate {
                    mode,
                    key,
                    fingerprint,
                };
                transactional::execute(inner, owner, request, config, Some(duplicate)).await
            });
            return claim_and_run.await;
        }
        let engine = &config.engine;
        let (claim, inner) = match engine.try_begin(&key, &fingerprint).await {
            Ok(Some(Begin::Run(claim))) => (claim, inner),
            Ok(Some(Begin::Replay(payload))) => return Ok(replay(&config, protocol, payload)),
            Ok(None) => {
                // A duplicate may wait a long time: it must not hold what the inner
                // service reserved when it was made ready (a concurrency permit, a pool
                // slot). It keeps an unreadied clone, readied only if it takes over.
                let unreadied = inner.clone();
                drop(inner);
                // Boxed: a rare path, kept out of every request's future.
                let deadline = call_deadline(protocol, &parts, arrived);
                match within(deadline, Box::pin(engine.wait_for(key, fingerprint))).await {
                    None => return Ok(render(&config, protocol, Rejection::DeadlineExceeded)),
                    Some(Ok(Begin::Run(claim))) => match ready(unreadied).await {
                        Ok(inner) => (claim, inner),
                        Err(error) => {
                            give_up(claim).await;
                            return Err(error);
                        }
                    },
                    Some(Ok(Begin::Replay(payload))) => {
                        return Ok(replay(&config, protocol, payload))
                    }
                    Some(Err(error)) => return Ok(render(&config, protocol, rejection_for(error))),
                }
            }
            Err(error) => return Ok(render(&config, protocol, rejection_for(error))),
        };
        handle(inner, claim, parts, body, config, protocol, arrived).await
    };
    // A disabled span (no subscriber records DEBUG: the usual production setting) would
    // still be entered and left on every poll of the request's work: about 160 instructions
    // a request (callgrind, benches/floor.rs).
    if span.is_disabled() {
        Box::pin(work)
    } else {
        Box::pin(work.instrument(span))
    }
}

/// A gRPC call's deadline (its `grpc-timeout` from when it arrived), which bounds its wait for
/// the first call with its key; `None` for HTTP or a call without one. Read when a wait
/// begins, so that the request's work need not carry it.
fn call_deadline(
    protocol: Protocol,
    parts: &http::request::Parts,
    arrived: Instant,
) -> Option<Instant> {
    protocol
        .is_grpc()
        .then(|| grpc::timeout_of(&parts.headers))
        .flatten()
        .map(|timeout| arrived + timeout)
}

/// Runs the handler for the claim's owner. Its future is boxed: it is as large as the user's
/// handler made it, and carried inline it would size the whole request's future, which a
/// replay allocates too (kept under 1 KiB, that allocation stays in malloc's per-thread cache).
/// A plain function, so the request it builds is not kept in the caller's state.
fn handle<S, ReqBody, ResBody>(
    inner: S,
    claim: Claim,
    parts: http::request::Parts,
    body: Bytes,
    config: Arc<Config>,
    protocol: Protocol,
    arrived: Instant,
) -> BoxFuture<Result<Response<ResponseBody>, S::Error>>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: From<Bytes> + Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let mut request = Request::from_parts(parts, ReqBody::from(body));
    request.extensions_mut().insert(claim.status());
    request
        .extensions_mut()
        .insert(crate::steps::KeyOwner::of(&claim));
    Box::pin(execute(inner, claim, request, config, protocol, arrived))
}

/// `wait` bounded by `deadline`: `None` when the deadline came first.
async fn within<F: Future>(deadline: Option<Instant>, wait: F) -> Option<F::Output> {
    match deadline {
        None => Some(wait.await),
        Some(deadline) => tokio::time::timeout_at(deadline, wait).await.ok(),
    }
}

/// Drives `service` to readiness.
async fn ready<S, R>(mut service: S) -> Result<S, S::Error>
where
    S: Service<R>,
{
    std::future::poll_fn(|cx| service.poll_ready(cx)).await?;
    Ok(service)
}

/// Transactional mode, a request without a key: no claim, but the handler still gets a
/// transaction, committed with its answer or rolled back by the same rule.
#[cfg(feature = "sqlx")]
pub(super) async fn unkeyed<S, ReqBody, ResBody>(
    inner: S,
    mode: SharedTxMode,
    request: Request<ReqBody>,
    config: std::sync::Arc<Config>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let owner = mode.begin_unkeyed();
    transactional::execute(inner, owner, request, config, None).await
}

/// Releases the key when the owner's work did not end in an outcome to store. Boxed: a rare
/// path, kept out of the state every request's future carries.
fn give_up(claim: Claim) -> BoxFuture<()> {
    Box::pin(async move {
        let _ = claim.release().await;
    })
}

/// Runs the inner service as the key's owner and records the outcome. `protocol`: the
/// request's, as `protect` read it (read again here, it cost a header lookup a request).
///
/// The service is called before the returned future starts, so that future carries the
/// handler's future and the claim, not the request and the service as well.
fn execute<S, ReqBody, ResBody>(
    mut inner: S,
    claim: Claim,
    request: Request<ReqBody>,
    config: std::sync::Arc<Config>,
    protocol: Protocol,
    arrived: Instant,
) -> impl Future<Output = Result<Response<ResponseBody>, S::Error>>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let handler = AssertUnwindSafe(inner.call(request)).catch_unwind();
    async move {
        let (release, answer) = settle(handler.await, claim, config, protocol, arrived);
        if let Some(release) = release {
            release.await;
        }
        answer
    }
}

/// What the owner's handler ended in: a final response passes on, teed for replay (the rest
/// of its body bounded, should its caller leave, by the lifetime of a request that `arrived`
/// then); its error, a panic or a response not to store gives the key up first (the release
/// returned). Not async, so the handler's outcome is not carried twice through the future's
/// states.
#[allow(clippy::type_complexity)]
fn settle<ResBody, E>(
    ended: Result<Result<Response<ResBody>, E>, Box<dyn std::any::Any + Send>>,
    claim: Claim,
    config: std::sync::Arc<Config>,
    protocol: Protocol,
    arrived: Instant,
) -> (Option<BoxFuture<()>>, Result<Response<ResponseBody>, E>)
where
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let response = match ended {
        Ok(Ok(response)) => response,
        Ok(Err(error)) => return (Some(give_up(claim)), Err(error)),
        Err(_panic) => {
            tracing::error!(key = %claim.key().log_id(), "inner service panicked; releasing the key");
            let answer = render(&config, protocol, Rejection::HandlerPanicked);
            return (Some(give_up(claim)), Ok(answer));
        }
    };
    let outcome = policy::outcome(&response, &config.is_final, &config.is_final_grpc);
    if outcome == Outcome::NotFinal {
        tracing::debug!(status = %response.status(), "outcome not final; releasing the key");
        return (Some(give_up(claim)), Ok(response.map(body::boxed)));
    }
    let (parts, response_body) = response.into_parts();
    // Passed through as it comes, copied for replay alongside; the claim is settled when the
    // body ends (see `tee`).
    let status = match outcome {
        Outcome::ByStatus(at) => Some(StatusWatch::new(at)),
        Outcome::Final | Outcome::NotFinal => None,
    };
    let deadline = arrived + config.max_handler_lifetime;
    let recorder = Recorder::new(
        claim,
        parts.status,
        &parts.headers,
        &response_body.size_hint(),
        config,
        status,
        deadline,
    );
    let body = body::boxed(Tee::new(body::boxed(response_body), recorder));
    (None, Ok(Response::from_parts(parts, body)))
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use std::convert::Infallible;

    use http_body_util::Full;

    use super::*;
    use crate::{engine::Engine, store::MemoryStore};

    /// A keyed request's work is one allocation, paid by every replay too: up to 1 KiB it
    /// comes from malloc's per-thread cache (glibc's tcache serves up to 1032 bytes) instead
    /// of its shared bins. The handler's future is boxed apart (see `handle`), so no handler
    /// can grow it; what can is a state added to this function's future.
    #[test]
    fn a_keyed_requests_work_fits_in_malloc_s_thread_cache() {
        let handler = tower::service_fn(|_: Request<Full<Bytes>>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
        });
        let config = Arc::new(Config::new(Engine::new(MemoryStore::new())));
        let request = Request::post("/payments")
            .header(http::header::AUTHORIZATION, "Bearer a")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        let work = protect(handler, config, "key".to_owned(), request, Instant::now());
        let size = std::mem::size_of_val(&*work);
        assert!(size <= 1024, "a keyed request's work takes {size} bytes");
    }
}
