//! The HTTP face: a tower layer over any `Service<http::Request<B>>`. Nothing below this
//! module knows about HTTP.
//!
//! # What the layer answers
//!
//! | situation | answer |
//! |---|---|
//! | first request with a key | the handler runs; a final response is stored |
//! | duplicate of a finished request | the stored response: same status, headers and body bytes |
//! | duplicate of a request still running | waits for it and replays its response (default, up to 10 s); past the wait, with `InProgressPolicy::Reject`, or beyond 1024 waiters on the key (`max_waiters_per_key`): `409` + `Retry-After` |
//! | no key, key optional (default) | passes through unprotected (never grouped under a shared key) |
//! | no key where the route requires one | `400` |
//! | key but no caller identity (no `Principal`, no `Authorization`, default scope) | `400` (`missing-identity`), nothing run or looked up; `shared_anonymous_scope()` opts into one shared scope |
//! | key empty, over 255 characters, not visible ASCII, or sent twice | `400` |
//! | same key, different method / path / query / body | `422` |
//! | request body over the limit (1 MiB) | `413`, handler not run |
//! | request body broken mid-upload | `400`, nothing claimed |
//! | store unreachable | `503` + `Retry-After`, handler **not** run |
//! | the key's record cannot be read (damaged, or written by something else; a stored response that does not decode) | `500` (`record-unreadable`), no `Retry-After`: its request may have run, so this one is not; answered (and counted, `record_unreadable`) until an operator removes the record with `Store::forget` |
//! | transactional mode: the commit refused by the database | `503` + `Retry-After` (`not-committed`), nothing persists |
//! | transactional mode: the connection breaks during the commit | `503` + `Retry-After` (`outcome-unknown`): it may have committed; a retry with the key replays it, or runs once if not. A request without a key: `500` (`outcome-unknown`), no `Retry-After`: nothing records it, so a retry may apply it twice |
//! | handler answers 5xx, 408, 409, 425 or 429, fails, or panics (→ `500`) | key released: a retry runs again |
//! | response over the storage limit (1 MiB) | streamed whole to the first caller, never run again; duplicates get `409` (`response-not-stored`) |
//! | streaming response (SSE, large download), trailers (gRPC, or gRPC-web's trailer frame) | passed to the first caller frame by frame, trailers included; recorded (body and trailers) when it ends, before the caller sees the end (a body of known length: its last frame is sent while a store that needs a round trip records it, and a retry arriving meanwhile waits for that record); a body that fails mid-stream releases the key |
//! | client hangs up | the handler finishes detached and is recorded; beyond 1024 detached handlers, or 60 s after the request arrived (`detach_limits`), it is dropped and the key released. A client that leaves after the headers of a streaming response: the rest of the body is read and recorded under the same two limits |
//!
//! Every rejection is `application/problem+json` (RFC 9457) with a stable `type`
//! (`urn:tower-idempotency:missing-key`, `invalid-key`, `missing-identity`, `key-reused`, `in-progress`,
//! `store-unavailable`, `record-unreadable`, `body-too-large`, `body-unreadable`, `response-not-stored`,
//! `handler-panicked`, `response-body-failed`, and in the transactional mode `not-committed`,
//! `outcome-unknown`, `transaction-held`); `IdempotencyLayer::on_rejection` replaces the
//! rendering.
//!
//! Details worth knowing:
//!
//! - **Which outcomes are final.** Every status except 5xx, 408, 409, 425 and 429 is stored and
//!   replayed — including 4xx. A handler that answered "invalid input" without doing anything
//!   can put `DoNotStore` in the response's extensions so that the fixed request may reuse its
//!   key; `IdempotencyLayer::store_status` changes the rule for all routes.
//! - **Keys are scoped** by the caller: the same key from two callers is two operations. By
//!   default the caller is the [`Principal`] your authentication layer put in the request's
//!   extensions after verifying its credentials (hashed, never stored raw), so a retry sent
//!   with a refreshed access token is replayed. **Without a principal the scope is a hash of
//!   the `Authorization` header**, and a token refreshed between an attempt and its retry (as
//!   OAuth SDKs do by themselves) lands in a new scope: the retry runs again. So put the
//!   authentication layer outside this one (it runs first) and have it insert a
//!   `Principal`; never build one from unverified token contents, or a forged token reads
//!   its victim's stored responses. `scope_with` scopes by anything else that identifies the
//!   caller (a tenant, a session, an mTLS identity; see its docs for a recipe).
//!   A keyed request without a principal or `Authorization` is refused with `400 missing-identity` rather than
//!   filed under one scope shared by every anonymous caller, where one caller would be replayed
//!   another's response, or learn through a `422` that a key exists. Refusing beats running it
//!   unprotected: its client sent a key because a retry must not run twice, and a silent
//!   pass-through would break that on the first retry. Services whose callers truly have no
//!   identity opt in with `shared_anonymous_scope()`.
//! - **Fingerprint.** Method, path, query and body bytes as sent (JSON differing only in
//!   whitespace is a different request), plus any header added with `fingerprint_header`.
//!   No request header counts by default, not even `Content-Type`, `Accept` or
//!   `Accept-Encoding`: a retry is the same operation however its client negotiates the
//!   answer, and a header in the fingerprint would turn a retry that changed it into a `422`.
//! - **Compression belongs outside the layer** (in axum, a `CompressionLayer` added after
//!   this layer; in a `ServiceBuilder`, before it). Then the stored response is the
//!   handler's own, and each duplicate is encoded for its own `Accept-Encoding`. Inside it,
//!   the first client's encoding is stored and every duplicate gets those bytes and that
//!   `Content-Encoding`, whatever it accepts. The same holds for any content negotiation a
//!   handler does: the replay is the first response, negotiated for the first request.
//! - **Replay.** Headers are stored as an ordered list of pairs, so repeated headers and values
//!   with commas survive; trailers are stored the same way and replayed after the body. Hop-by-hop headers and `Date` are dropped; `Set-Cookie` is dropped
//!   unless `replay_set_cookie(true)`. `mark_replayed(true)` adds `Idempotent-Replayed: true`
//!   (off by default: a duplicate cannot tell it lost the race).
//! - **Disconnects.** A client that hangs up does not cut the handler in half: the rest of it
//!   moves to a task of its own, finishes, and its response is stored for the retry. Outer
//!   `TimeoutLayer` / `ConcurrencyLimitLayer` no longer bound it then, so the layer does:
//!   `detach_limits(max, lifetime)` (default 1024 at once, 60 s after the request arrived). A
//!   handler beyond either limit is dropped and its key released, so a retry runs it again.
//!   `detach(false)` releases the key whenever the request is dropped. At shutdown,
//!   `layer.engine().drained()` waits until every such handler has recorded its outcome or
//!   released its key.
//! - **Leases.** A claim lives for a lease (30 s) that a task of its own renews every quarter
//!   of it while the handler runs, retrying a failed renewal after a sixteenth; each attempt is
//!   bounded by the store timeout (5 s). So the lease survives two failed or hung renewals in a
//!   row, and a handler that blocks its thread cannot starve it. It still runs out if the owner
//!   process dies, or if the store stays unreachable for most of a lease; then the next
//!   duplicate takes the key over in the same atomic operation. The handler can tell: the
//!   request's extensions hold an `engine::ClaimStatus` (`is_lost()`, `lost().await`) to check
//!   before an irreversible step. Complete and release are fenced by the claim's token: an owner
//!   that lost its lease cannot overwrite the new owner's record; a `complete` whose answer was
//!   lost is confirmed with a lookup before it is reported as not recorded.
//! - **Timings.** `Engine::builder(store)` sets lease, retention, in-progress policy,
//!   `retry_after`, `store_timeout` and `max_waiters_per_key`; `build()` checks them together
//!   and returns a `ConfigError` naming what to change: a zero lease or retention, a lease too
//!   short to survive two renewals of up to `store_timeout` (`lease/4 + 3 × store_timeout +
//!   lease/8 ≤ lease`), durations too long for the stores' clocks. `IdempotencyLayer::from_engine`
//!   takes the result.
//! - **Waiting duplicates** of one key in one process share one watch on the store (a single
//!   poll with capped backoff, woken at once when the owner is in the same process, and by the
//!   store's completion notification when it is in another: Redis pub/sub and, opted in with
//!   `PostgresStoreBuilder::completion_notifications` (it costs commit parallelism),
//!   PostgreSQL `LISTEN/NOTIFY`, one listening connection per process; the transactional mode
//!   waits on the owner's lock instead; MySQL, SQLite and Redis Cluster poll, 5 ms
//!   doubling to 250 ms; with notifications the poll only backs them up,
//!   `EngineBuilder::poll_when_notified`), and give
//!   back what the inner service reserved when it was made ready while they wait. They keep
//!   their request body (at most `max_request_body`): a waiter that finds the key released
//!   takes it over and runs the request.
//! - **Kill switch.** `enabled(false)` makes the layer a pass-through.
//!
//! # The retention guarantee, and when it ends
//!
//! A completed key is replayed for the retention period (`retention`, default **24 hours**),
//! measured by the store's clock. **After it, the same key is a brand-new request and runs
//! again.** Choose a retention longer than your clients' realistic retry horizon (a day covers
//! transport-level redelivery; a week covers manual replays), and document it in your API.
//! SQL stores delete expired records with `purge_expired` (in bounded batches) or the
//! background task `store::spawn_purger`; Redis and the memory store expire them by themselves.

mod answer;
mod body;
mod bounds;
#[cfg(feature = "sqlx")]
mod collect;
#[cfg(feature = "sqlx")]
mod commit_at_end;
mod config;
mod detach;
mod fingerprint;
// Property-based tests of the parsers of outside bytes (issue 24, part 3).
#[cfg(test)]
mod fuzz;
pub mod grpc;
mod grpc_web;
mod held_end;
mod key;
mod layer;
mod message_key;
mod policy;
mod rejection;
mod replay;
mod request_body;
mod scope;
mod service;
mod tee;
#[cfg(feature = "sqlx")]
mod transactional;
#[cfg(feature = "sqlx")]
mod tx_mode;

pub use body::ResponseBody;
pub use config::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};
pub use grpc::{grpc_message, is_final_grpc_by_default};
pub use key::{InvalidKey, MAX_KEY_LEN};
pub use layer::IdempotencyLayer;
pub use policy::{is_final_by_default, DoNotStore};
pub use rejection::Rejection;
pub use scope::Principal;
pub use service::{IdempotencyService, ResponseFuture};
