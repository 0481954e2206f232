//! Metrics through the [`metrics`](https://docs.rs/metrics) facade: every metric name this
//! crate records, and the one place that records each.
//!
//! Recording happens only with the cargo feature `metrics`. Without it the functions below are
//! empty and inlined away, so a build that does not want metrics pays nothing, not even the
//! facade's check for an installed recorder. With it, and no recorder installed, each event
//! costs a thread-local read and two atomic loads (the facade's no-op recorder); install any
//! `metrics` recorder (for example `metrics-exporter-prometheus`) to collect them. A feature
//! rather than an always-on dependency because it is the convention of the ecosystem
//! (tower-http, sqlx) and keeps the dependency out of the tree of users who never look at
//! metrics.
//!
//! Every event goes to the recorder current where it happens, global or local
//! (`metrics::with_local_recorder`), as with the facade's macros. For the global recorder the
//! crate registers the handles of the events every request records once, at the first such
//! event after the recorder was installed, and keeps them; a local recorder is looked up at
//! every event.
//!
//! The names are public so dashboards and tests need not repeat string literals.
//!
//! The `payments` example serves them at `GET /metrics` with `metrics-exporter-prometheus`.
//!
//! | Metric | Kind | Labels |
//! |---|---|---|
//! | `idempotency_requests_total` | counter | `outcome`: `executed`, `replayed`, `key_reused`, `in_progress`, `store_unavailable`, `busy`, `record_unreadable` (a record that cannot be read, until an operator forgets it), `rejected` (with `reason`: `missing_key`, `invalid_key`, `missing_identity`, `body_unreadable`, `body_too_large`, `handler_panicked`, `response_body_failed`, `not_committed`, `outcome_unknown` (a commit whose connection broke: it may have committed), `transaction_held`, `not_unary`, `deadline_exceeded`) |
//! | `idempotency_waits_total`, `idempotency_wait_seconds` | counter, histogram | |
//! | `idempotency_store_operation_seconds` | histogram | `operation`: `claim`, `lookup`, `complete`, `release` |
//! | `idempotency_store_errors_total` | counter | `operation` |
//! | `idempotency_claims_in_flight` | gauge | |
//! | `idempotency_outbox_refused_total` | counter | `outcome`: `retried` (the row is tried again later), `parked` (its last attempt: it waits for an operator) |

/// Requests (engine operations) by outcome, a counter labelled `outcome`: one of
/// [`EXECUTED`], [`REPLAYED`], [`KEY_REUSED`], [`IN_PROGRESS`], [`STORE_UNAVAILABLE`], or
/// [`REJECTED`] (a 4xx or 5xx answered by the HTTP layer before the engine was asked, or
/// after the handler ran), which also carries a `reason` label.
pub const REQUESTS: &str = "idempotency_requests_total";
/// Duplicates that waited for their original to finish, a counter.
pub const WAITS: &str = "idempotency_waits_total";
/// How long each of those duplicates waited, in seconds, a histogram.
pub const WAIT_SECONDS: &str = "idempotency_wait_seconds";
/// How long each store operation took, in seconds, a histogram labelled `operation`
/// (`claim`, `lookup`, `complete`, `release`).
pub const STORE_SECONDS: &str = "idempotency_store_operation_seconds";
/// Store operations that failed (time-outs included), a counter labelled `operation`.
pub const STORE_ERRORS: &str = "idempotency_store_errors_total";
/// Claims held right now by this process, a gauge.
pub const CLAIMS_IN_FLIGHT: &str = "idempotency_claims_in_flight";

/// Outbox rows the broker refused (see `outbox::RefusalPolicy`), a counter labelled
/// `outcome`: [`RETRIED`] or [`PARKED`].
pub const OUTBOX_REFUSED: &str = "idempotency_outbox_refused_total";
/// The `outcome` of a refused outbox row that gets another attempt later.
pub const RETRIED: &str = "retried";
/// The `outcome` of a refused outbox row that spent its last attempt and is parked.
pub const PARKED: &str = "parked";

/// The `outcome` of a request whose key it claimed, so its operation runs.
pub const EXECUTED: &str = "executed";
/// The `outcome` of a request answered with the stored outcome of an earlier one.
pub const REPLAYED: &str = "replayed";
/// The `outcome` of a request whose key was used before with a different request.
pub const KEY_REUSED: &str = "key_reused";
/// The `outcome` of a duplicate told that its original is still running (409).
pub const IN_PROGRESS: &str = "in_progress";
/// The `outcome` of a request the store could not serve (503).
pub const STORE_UNAVAILABLE: &str = "store_unavailable";
/// The `outcome` of a request whose turn at a busy single-writer database (SQLite) did not
/// come within its wait (409).
pub const BUSY: &str = "busy";
/// The `outcome` of a request whose key holds a record that cannot be read (damaged, or
/// written by something else): answered `500` `record-unreadable` until an operator forgets
/// the record (`Store::forget`). A record whose stored HTTP response cannot be decoded is
/// counted here too, after its lookup was counted as [`REPLAYED`].
pub const RECORD_UNREADABLE: &str = "record_unreadable";
/// The `outcome` of a request the HTTP layer rejected itself; see its `reason` label.
pub const REJECTED: &str = "rejected";
/// The `reason` of a [`REJECTED`] request whose transaction's `COMMIT` lost its connection
/// (transactional mode, 503 `outcome-unknown`): it may have committed; its retry learns.
pub const OUTCOME_UNKNOWN: &str = "outcome_unknown";

#[cfg(feature = "metrics")]
mod hot;
#[cfg(feature = "metrics")]
mod keys;

/// Counts one request with `outcome` (one of the outcome constants of this module).
#[inline]
pub(crate) fn request(outcome: &'static str) {
    #[cfg(feature = "metrics")]
    match keys::index(&keys::OUTCOMES, outcome) {
        Some(outcome) => hot::outcome(outcome, |counter| counter.increment(1)),
        None => ::metrics::counter!(REQUESTS, "outcome" => outcome).increment(1),
    }
    #[cfg(not(feature = "metrics"))]
    let _ = outcome;
}

/// Counts one request the HTTP layer rejected for `reason`.
#[inline]
pub(crate) fn rejected(reason: &'static str) {
    #[cfg(feature = "metrics")]
    ::metrics::counter!(REQUESTS, "outcome" => REJECTED, "reason" => reason).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = reason;
}

/// Counts a rejection the HTTP layer decided itself. The engine's own answers (key reused, in
/// progress, store unavailable) were counted where the engine gave them, and a response too
/// large to store was counted as a replay.
pub(crate) fn http_rejection(rejection: &crate::http::Rejection) {
    use crate::http::Rejection as R;
    let reason = match rejection {
        R::KeyReused
        | R::InProgress { .. }
        | R::StoreBusy { .. }
        | R::StoreUnavailable { .. }
        | R::RecordUnreadable => return,
        R::ResponseNotStored { .. } => return,
        R::MissingKey | R::MissingMessageKey => "missing_key",
        R::InvalidKey(_) => "invalid_key",
        R::MissingIdentity => "missing_identity",
        R::BodyUnreadable => "body_unreadable",
        R::BodyTooLarge { .. } => "body_too_large",
        R::HandlerPanicked => "handler_panicked",
        R::ResponseBodyFailed => "response_body_failed",
        R::NotCommitted { .. } => "not_committed",
        R::OutcomeUnknown { .. } | R::OutcomeUnknownWithoutKey => OUTCOME_UNKNOWN,
        R::TransactionHeld => "transaction_held",
        R::NotUnary => "not_unary",
        R::DeadlineExceeded => "deadline_exceeded",
    };
    rejected(reason);
}

/// Times a store operation: records its latency, and an error when it failed.
///
/// A future of its own rather than an `async fn`, which would hold `call` twice (as its
/// argument and as the awaited future) in the state of every store call.
#[inline]
pub(crate) fn store_call<T, E, F>(
    operation: &'static str,
    call: F,
) -> impl std::future::Future<Output = Result<T, E>>
where
    F: std::future::Future<Output = Result<T, E>>,
{
    timed(operation, None, call)
}

/// [`store_call`] for a call whose caller read the clock just before making it: its start
/// is that reading, one clock read fewer per request (the claim's lease starts there too).
#[inline]
pub(crate) fn store_call_since<T, E, F>(
    operation: &'static str,
    started: std::time::Instant,
    call: F,
) -> impl std::future::Future<Output = Result<T, E>>
where
    F: std::future::Future<Output = Result<T, E>>,
{
    timed(operation, Some(started), call)
}

#[inline]
fn timed<T, E, F>(
    operation: &'static str,
    started: Option<std::time::Instant>,
    call: F,
) -> impl std::future::Future<Output = Result<T, E>>
where
    F: std::future::Future<Output = Result<T, E>>,
{
    #[cfg(feature = "metrics")]
    {
        Timed {
            operation,
            started,
            call,
        }
    }
    #[cfg(not(feature = "metrics"))]
    {
        let _ = (operation, started);
        call
    }
}

#[cfg(feature = "metrics")]
pin_project_lite::pin_project! {
    /// A store call, timed from its first poll to its end.
    struct Timed<F> {
        operation: &'static str,
        started: Option<std::time::Instant>,
        #[pin]
        call: F,
    }
}

#[cfg(feature = "metrics")]
impl<T, E, F> std::future::Future for Timed<F>
where
    F: std::future::Future<Output = Result<T, E>>,
{
    type Output = Result<T, E>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = self.project();
        let started = *this.started.get_or_insert_with(std::time::Instant::now);
        let result = std::task::ready!(this.call.poll(cx));
        let seconds = started.elapsed().as_secs_f64();
        let operation = *this.operation;
        match keys::index(&keys::OPERATIONS, operation) {
            Some(operation) => hot::operation(operation, |histogram| histogram.record(seconds)),
            None => ::metrics::histogram!(STORE_SECONDS, "operation" => operation).record(seconds),
        }
        if result.is_err() {
            ::metrics::counter!(STORE_ERRORS, "operation" => operation).increment(1);
        }
        std::task::Poll::Ready(result)
    }
}

/// A duplicate waiting for its original: counted when it starts, its wait recorded when it
/// ends (dropped), whichever way it ends.
pub(crate) struct Wait {
    #[cfg(feature = "metrics")]
    started: std::time::Instant,
}

impl Wait {
    #[inline]
    pub(crate) fn start() -> Self {
        #[cfg(feature = "metrics")]
        ::metrics::counter!(WAITS).increment(1);
        Self {
            #[cfg(feature = "metrics")]
            started: std::time::Instant::now(),
        }
    }
}

#[cfg(feature = "metrics")]
impl Drop for Wait {
    fn drop(&mut self) {
        ::metrics::histogram!(WAIT_SECONDS).record(self.started.elapsed().as_secs_f64());
    }
}

/// Counts one outbox row the broker refused, parked by this refusal or not.
#[cfg(feature = "sqlx")]
#[inline]
pub(crate) fn outbox_refused(parked: bool) {
    #[cfg(feature = "metrics")]
    ::metrics::counter!(OUTBOX_REFUSED, "outcome" => if parked { PARKED } else { RETRIED })
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = parked;
}

/// Moves the claims-in-flight gauge by `delta` (+1 on a claim, -1 when it ends).
#[inline]
pub(crate) fn claims_in_flight(delta: f64) {
    #[cfg(feature = "metrics")]
    hot::claims_in_flight(|gauge| gauge.increment(delta));
    #[cfg(not(feature = "metrics"))]
    let _ = delta;
}
