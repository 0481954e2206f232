//! What the layer is configured with, shared (behind one `Arc`) by the layer, every service it
//! makes, and every request in flight.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http::{HeaderName, Method, Response};
use tokio::sync::Semaphore;

use super::{policy, rejection::Rejection, scope};
use crate::engine::Engine;

/// The header the key is read from by default.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The header added to replayed responses when
/// [`IdempotencyLayer::mark_replayed`](super::IdempotencyLayer::mark_replayed) is on.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

pub(crate) type RejectionFn = Arc<dyn Fn(Rejection) -> Response<Bytes> + Send + Sync>;

/// Everything a request needs from its layer, the engine included: axum clones the service
/// for every request and the service hands this to the request's work, so one reference
/// count moves instead of one per part.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) engine: Engine,
    /// Set in the transactional mode: claims, runs and records in one transaction.
    #[cfg(feature = "sqlx")]
    pub(crate) transactional: Option<super::tx_mode::SharedTxMode>,
    pub(crate) enabled: bool,
    pub(crate) header: HeaderName,
    pub(crate) methods: Vec<Method>,
    pub(crate) key_required: bool,
    pub(crate) scope: scope::ScopeFn,
    pub(crate) anonymous_scope: bool,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) max_request_body: usize,
    pub(crate) max_response_body: usize,
    pub(crate) is_final: policy::StatusPolicy,
    pub(crate) is_final_grpc: policy::GrpcStatusPolicy,
    pub(crate) replay_set_cookie: bool,
    pub(crate) mark_replayed: bool,
    pub(crate) detach: bool,
    /// Shared by every clone of the layer: one permit per detached handler.
    pub(crate) detached: Arc<Semaphore>,
    pub(crate) max_handler_lifetime: Duration,
    pub(crate) rejection: RejectionFn,
    /// gRPC methods (by path) whose key may come from the request message.
    pub(crate) message_keys: Vec<(String, super::message_key::MessageKeyFn)>,
}

const DEFAULT_MAX_DETACHED: usize = 1024;

impl Config {
    /// The defaults the layer documents, over `engine`.
    pub(crate) fn new(engine: Engine) -> Self {
        Self {
            engine,
            #[cfg(feature = "sqlx")]
            transactional: None,
            enabled: true,
            header: IDEMPOTENCY_KEY,
            methods: vec![Method::POST, Method::PATCH],
            key_required: false,
            scope: Arc::new(scope::by_caller),
            anonymous_scope: false,
            fingerprint_headers: Vec::new(),
            max_request_body: 1024 * 1024,
            max_response_body: 1024 * 1024,
            is_final: Arc::new(policy::is_final_by_default),
            is_final_grpc: Arc::new(super::grpc::is_final_grpc_by_default),
            replay_set_cookie: false,
            mark_replayed: false,
            detach: true,
            detached: Arc::new(Semaphore::new(DEFAULT_MAX_DETACHED)),
            max_handler_lifetime: Duration::from_secs(60),
            rejection: Arc::new(Rejection::into_http_response),
            message_keys: Vec::new(),
        }
    }
}
