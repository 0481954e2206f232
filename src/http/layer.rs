//! [`IdempotencyLayer`]: the configuration, cheap to clone (everything behind one `Arc`).

use std::{sync::Arc, time::Duration};

use tokio::sync::Semaphore;

use bytes::Bytes;
use http::{request::Parts, HeaderName, Method, Response, StatusCode};

use super::{config::Config, rejection::Rejection};
use crate::{engine::Engine, store::Store};

/// Makes retries of a service safe: the first request with an `Idempotency-Key` runs, every
/// duplicate — later or concurrent — gets the first one's response.
///
/// The key is claimed in one atomic store operation before the inner service runs, so
/// duplicates that arrive together cannot both run. See the [crate docs](crate) for the full
/// behaviour and the status table.
///
/// ```
/// use axum::{routing::post, Router};
/// use tower_idempotency::{store::MemoryStore, IdempotencyLayer};
///
/// let app: Router = Router::new()
///     .route("/payments", post(|| async { "charged" }))
///     .layer(IdempotencyLayer::new(MemoryStore::new()).require_key());
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

impl IdempotencyLayer {
    /// A layer over `store` with the defaults: POST and PATCH, key optional, scoped by the
    /// caller's [`Principal`](super::Principal) (else a hash of the `Authorization` header), 30 s lease, 24 h retention, duplicates of a running request
    /// wait up to 10 s, 1 MiB request and response limits. Other timings: build an engine
    /// with [`Engine::builder`] and use [`from_engine`](Self::from_engine).
    pub fn new(store: impl Store) -> Self {
        Self::from_engine(Engine::new(store))
    }

    /// A layer over an [`Engine`] you configured (or share with a message consumer).
    pub fn from_engine(engine: Engine) -> Self {
        Self {
            config: Arc::new(Config::new(engine)),
        }
    }

    /// A layer in the transactional mode: the claim, the handler's own database writes and
    /// the stored response commit in ONE transaction, so a crash at any instant leaves either
    /// nothing (the retry runs once) or the effect with its stored response (the retry
    /// replays). The handler gets the transaction through the request's extensions
    /// ([`TxSlot`](crate::transactional::TxSlot); with the `axum` feature the
    /// [`Tx`](crate::transactional::Tx) extractor). See the [`transactional`](crate::transactional)
    /// module for the guarantees and what differs from the separate mode:
    ///
    /// - a response that is not stored (5xx, 408, 409, 425, 429, [`DoNotStore`](super::DoNotStore),
    ///   an error or a panic) rolls back the handler's writes too;
    /// - the response body is read before the commit, so the client only ever sees an answer
    ///   whose record committed; a failed commit answers 503 `not-committed` (a gRPC stream
    ///   over the response limit streams first, and holds back only its status);
    /// - requests without a key (where the key is optional) still get a transaction,
    ///   committed or rolled back by the same rule, but nothing is recorded for them;
    /// - the lease is not needed to recover from a crash; it bounds how long an owner's
    ///   transaction may stay idle where the database enforces that (PostgreSQL).
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) {
    /// use tower_idempotency::{store::PostgresStore, transactional::Transactional, IdempotencyLayer};
    /// let layer = IdempotencyLayer::transactional(Transactional::new(PostgresStore::new(pool)));
    /// # }
    /// ```
    #[cfg(feature = "sqlx")]
    pub fn transactional<S: crate::transactional::TransactionalStore>(
        mode: crate::transactional::Transactional<S>,
    ) -> Self {
        Self::from_engine(mode.engine().clone()).with(|c| c.transactional = Some(Arc::new(mode)))
    }

    fn with(mut self, change: impl FnOnce(&mut Config)) -> Self {
        change(Arc::make_mut(&mut self.config));
        self
    }

    /// `false` turns the layer into a pass-through (a kill switch for tests and incidents).
    pub fn enabled(self, enabled: bool) -> Self {
        self.with(|c| c.enabled = enabled)
    }

    /// Reads the key from `header` instead of `Idempotency-Key`.
    pub fn header_name(self, header: HeaderName) -> Self {
        self.with(|c| c.header = header)
    }

    /// The methods the layer applies to (default POST and PATCH). Others pass through
    /// untouched; GET, HEAD and OPTIONS are safe and should stay out of this list.
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.with(|c| c.methods = methods)
    }

    /// Requests without a key are refused with 400 (default: they pass through and run
    /// without protection — they are never grouped under some shared key).
    pub fn require_key(self) -> Self {
        self.with(|c| c.key_required = true)
    }

    /// Scopes keys by what `scope` returns for the request head, instead of the default (the
    /// [`Principal`](super::Principal), else a hash of the `Authorization` header). Every
    /// request then has a scope: return a value that differs per caller, derived from what
    /// your authentication layer verified, never from what the client merely sent (an
    /// unverified token's claims, a tenant header the caller chooses): whoever can choose the
    /// scope reads the stored responses of that scope.
    ///
    /// The recipe for a caller your authentication layer put in the extensions as a type of
    /// its own (here a session), when inserting a `Principal` is not an option:
    ///
    /// ```
    /// use tower_idempotency::{store::MemoryStore, IdempotencyLayer};
    ///
    /// /// What the session middleware inserts once it has checked the session cookie.
    /// #[derive(Clone)]
    /// struct Session {
    ///     user_id: u64,
    /// }
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).scope_with(|parts| {
    ///     match parts.extensions.get::<Session>() {
    ///         Some(session) => format!("user:{}", session.user_id),
    ///         // Not signed in: one scope for all of them; or keep the default and let the
    ///         // layer refuse keyed anonymous requests (`400 missing-identity`).
    ///         None => "anonymous".to_owned(),
    ///     }
    /// });
    /// ```
    pub fn scope_with<F>(self, scope: F) -> Self
    where
        F: Fn(&Parts) -> String + Send + Sync + 'static,
    {
        self.with(|c| c.scope = Arc::new(move |parts| Some(scope(parts))))
    }

    /// Lets keyed requests without an `Authorization` header share one anonymous scope
    /// (default: they are refused with 400 `missing-identity`, see
    /// [`Rejection::MissingIdentity`]). Only for services whose callers really have no
    /// identity: any caller can then replay another caller's response by sending its key, and
    /// learn whether a key was used (422). Services that identify callers by a cookie, an API
    /// key header or a client certificate should use [`scope_with`](Self::scope_with)
    /// instead.
    pub fn shared_anonymous_scope(self) -> Self {
        self.with(|c| c.anonymous_scope = true)
    }

    /// Also fingerprints header `name` (method, path, query and body always count; no header
    /// does by default). A retry whose value of `name` differs is then another request under
    /// the same key (`422`), so add only headers that change what the request does, never
    /// negotiation headers such as `Accept-Encoding` (compression belongs outside the layer:
    /// see the [`http`](crate::http) docs).
    pub fn fingerprint_header(self, name: HeaderName) -> Self {
        self.with(|c| c.fingerprint_headers.push(name))
    }

    /// The largest request body accepted on protected requests (default 1 MiB); larger ones
    /// get 413 and do not run. The body must be read whole to fingerprint it.
    pub fn max_request_body(self, bytes: usize) -> Self {
        self.with(|c| c.max_request_body = bytes)
    }

    /// The largest response body stored for replay (default 1 MiB). A larger response is still
    /// sent in full to the first caller and is never run again for its key: duplicates get
    /// [`Rejection::ResponseNotStored`] (409) until the retention ends.
    pub fn max_response_body(self, bytes: usize) -> Self {
        self.with(|c| c.max_response_body = bytes)
    }

    /// Which statuses are final: stored and replayed. The others release the key so a retry
    /// runs again. Default: [`is_final_by_default`](super::is_final_by_default).
    pub fn store_status<F>(self, is_final: F) -> Self
    where
        F: Fn(StatusCode) -> bool + Send + Sync + 'static,
    {
        self.with(|c| c.is_final = Arc::new(is_final))
    }

    /// Which `grpc-status` codes of a gRPC call are final: stored and replayed. The others
    /// release the key so a retry runs again. Default:
    /// [`is_final_grpc_by_default`](super::is_final_grpc_by_default) (see the
    /// [`grpc`](crate::http::grpc) docs for the table). [`store_status`](Self::store_status) still
    /// applies to the HTTP status of a gRPC response (always 200 from a gRPC server).
    ///
    /// ```
    /// use tower_idempotency::{is_final_grpc_by_default, store::MemoryStore, IdempotencyLayer};
    /// // Also release the key after NOT_FOUND (5): the resource may appear later.
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .store_grpc_status(|code| code != 5 && is_final_grpc_by_default(code));
    /// ```
    pub fn store_grpc_status<F>(self, is_final: F) -> Self
    where
        F: Fn(i32) -> bool + Send + Sync + 'static,
    {
        self.with(|c| c.is_final_grpc = Arc::new(is_final))
    }

    /// Takes the key of gRPC calls to the method at `path` (`/package.Service/Method`) from
    /// the request message, the way Google AIP-155 has clients send a `request_id` field.
    /// `key` gets the message bytes (the frame's length prefix stripped, see
    /// [`grpc_message`](super::grpc_message)) and returns the key, or `None` when the message
    /// carries none. Register each unary method whose message holds a key; calling it again
    /// for a path replaces its extractor.
    ///
    /// - **The metadata key wins.** A call that sends an `idempotency-key` metadata entry
    ///   (the [`header_name`](Self::header_name)) is keyed by it, and its message is not asked;
    ///   the message, `request_id` included, still counts in the fingerprint, so the same key
    ///   with another `request_id` is another request (`INVALID_ARGUMENT`).
    /// - **The same rules as a header key.** The key returned must be 1 to
    ///   [`MAX_KEY_LEN`](super::MAX_KEY_LEN) visible ASCII characters, else the call is refused
    ///   with `INVALID_ARGUMENT` and nothing runs (return `None` for proto3's empty string if an
    ///   absent `request_id` means "no key"). No key at all: as without a header, the call runs
    ///   unprotected, or gets `INVALID_ARGUMENT` under [`require_key`](Self::require_key).
    /// - **Read before it runs.** A call to such a method is read whole (up to
    ///   [`max_request_body`](Self::max_request_body)) before anything else, so register
    ///   unary methods only: a body that is not exactly one message is refused with
    ///   `UNIMPLEMENTED`. A compressed message is not decoded by the layer: such a call's key
    ///   must come as metadata.
    ///
    /// ```
    /// use prost::Message;
    /// use tower_idempotency::{store::MemoryStore, IdempotencyLayer};
    ///
    /// /// `payments.ChargeRequest`, as far as the key goes: prost skips the fields it does
    /// /// not declare, so only `request_id` (field 4 in the .proto) needs writing out.
    /// #[derive(Clone, PartialEq, prost::Message)]
    /// struct RequestId {
    ///     #[prost(string, tag = "4")]
    ///     request_id: String,
    /// }
    ///
    /// fn request_id(message: &[u8]) -> Option<String> {
    ///     let id = RequestId::decode(message).ok()?.request_id;
    ///     // proto3: an unset string decodes as "", which here means "no key".
    ///     (!id.is_empty()).then_some(id)
    /// }
    ///
    /// let message = RequestId { request_id: "9b1d-42".into() }.encode_to_vec();
    /// assert_eq!(request_id(&message).as_deref(), Some("9b1d-42"));
    /// assert_eq!(request_id(&[]), None);
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .key_from_message("/payments.Payments/Charge", request_id);
    /// ```
    pub fn key_from_message<F>(self, path: impl Into<String>, key: F) -> Self
    where
        F: Fn(&[u8]) -> Option<String> + Send + Sync + 'static,
    {
        let path = path.into();
        let key: super::message_key::MessageKeyFn = Arc::new(key);
        self.with(|c| {
            c.message_keys.retain(|(registered, _)| *registered != path);
            c.message_keys.push((path, key));
        })
    }

    /// Replays `Set-Cookie` headers too (default: dropped from stored responses, since a
    /// session cookie meant for one response should not be handed out again).
    pub fn replay_set_cookie(self, replay: bool) -> Self {
        self.with(|c| c.replay_set_cookie = replay)
    }

    /// Adds `Idempotent-Replayed: true` to replayed responses (default off: a duplicate
    /// cannot tell it lost the race).
    pub fn mark_replayed(self, mark: bool) -> Self {
        self.with(|c| c.mark_replayed = mark)
    }

    /// Keeps the handler running when its client disconnects (default on): the rest of it
    /// moves to a task of its own, finishes, and its response is stored. (Only a disconnect
    /// costs a task; a request whose client waits runs in the caller's task.) Off: a
    /// disconnect drops the handler and releases the key.
    pub fn detach(self, detach: bool) -> Self {
        self.with(|c| c.detach = detach)
    }

    /// Bounds the handlers that run on after their client left, which outer layers
    /// (`TimeoutLayer`, `ConcurrencyLimitLayer`) no longer bound: at most `max` of them at
    /// once (default 1024), each ended `lifetime` after its request arrived (default 60 s).
    /// The rest of a response body whose client left mid-stream (after the headers of a
    /// server-sent event stream, say) is read under the same limits, sharing the `max` slots.
    /// A handler that finds no free slot when its client leaves, or outlives `lifetime`, is
    /// dropped and its key released (a retry runs it again), so
    /// [`Engine::drained`] finishes.
    ///
    /// Any value is accepted: a `lifetime` of zero drops a handler as soon as its client
    /// leaves; one longer than a century (`Duration::MAX` for "no limit") counts as a century.
    pub fn detach_limits(self, max: usize, lifetime: Duration) -> Self {
        self.with(|c| {
            c.detached = Arc::new(Semaphore::new(max.min(Semaphore::MAX_PERMITS)));
            // Saturated here, so the deadline each request computes cannot overflow.
            c.max_handler_lifetime = lifetime.min(crate::clock::FOREVER);
        })
    }

    /// Renders rejections your way instead of problem+json.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use tower_idempotency::{store::MemoryStore, IdempotencyLayer, Rejection};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).on_rejection(|rejection: Rejection| {
    ///     let mut response = http::Response::new(Bytes::from(rejection.problem().type_uri()));
    ///     *response.status_mut() = rejection.status();
    ///     response
    /// });
    /// ```
    pub fn on_rejection<F>(self, render: F) -> Self
    where
        F: Fn(Rejection) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.with(|c| c.rejection = Arc::new(render))
    }

    /// The engine, e.g. to share it with a message consumer.
    pub fn engine(&self) -> &Engine {
        &self.config.engine
    }

    /// The configuration every service made from this layer shares.
    pub(crate) fn config(&self) -> &Arc<Config> {
        &self.config
    }
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("engine", &self.config.engine)
            .field("enabled", &self.config.enabled)
            .field("header", &self.config.header)
            .field("methods", &self.config.methods)
            .field("key_required", &self.config.key_required)
            .finish_non_exhaustive()
    }
}
