//! Optimistic concurrency: versioned rows, compare-and-set updates, and their HTTP face
//! (strong ETags, `If-Match` / `If-None-Match`, 412 / 428 / 304).
//!
//! Every row carries a version that each successful write raises by one. A writer states
//! the version it read; the write succeeds only if the row is still at that version, which
//! the database decides inside the one UPDATE statement that also writes the values. The
//! loser learns the current version (→ `412 Precondition Failed` with the current `ETag`) and
//! may re-read and try again ([`retry_on_conflict`]).
//!
//! | piece | what it is |
//! |---|---|
//! | `VersionedTable` (features `postgres`, `sqlite`, `mysql`) | `update_if_version` / `insert_new` over sqlx (PostgreSQL, SQLite, MySQL / MariaDB) |
//! | [`MemoryVersioned`] | the same semantics for an in-process map |
//! | [`retry_on_conflict`] | re-run a read-modify-write while it loses races |
//! | [`ETag`], [`ETagList`], [`Preconditions`] | entity tags and RFC 9110 precondition evaluation |
//! | [`PreconditionRejection`] | 400 / 404 / 412 / 428 problem+json, 304 |
//! | `RequireIfMatch` | (feature `axum`) an extractor answering 428 without `If-Match` |
//!
//! `VersionedTable::update_if_version` is one SQL statement on PostgreSQL, SQLite and MySQL /
//! MariaDB, on any sqlx executor (pool, connection or transaction). Weak tags never match
//! `If-Match`, `*` matches only an existing resource, a malformed tag is a 400, and
//! `If-None-Match` gives 304 on GET. `cargo run --example versioned_flow` shows the whole
//! flow, and the `payments` example's `PATCH /payments/{id}` uses it over HTTP.
//!
//! ```
//! use http::{HeaderMap, HeaderValue};
//! use tower_idempotency::version::{ETag, MemoryVersioned, Preconditions, PreconditionRejection};
//!
//! let payments = MemoryVersioned::new();
//! let _ = payments.insert_new("pay_1", "pending");
//!
//! // A client read version 1 ("ETag: \"1\"") and sends it back with its change.
//! let mut headers = HeaderMap::new();
//! headers.insert("if-match", HeaderValue::from_static("\"1\""));
//! let pre = Preconditions::from_headers(&headers).unwrap().require_if_match().unwrap();
//! let (version, _) = payments
//!     .update_if_version(&"pay_1", pre.expected(), |s| *s = "paid")
//!     .into_http()
//!     .unwrap();
//! assert_eq!(ETag::from(version).to_string(), "\"2\"");
//!
//! // The same stale If-Match again: 412 carrying the current ETag.
//! let rejection = payments
//!     .update_if_version(&"pay_1", pre.expected(), |s| *s = "failed")
//!     .into_http()
//!     .unwrap_err();
//! assert_eq!(rejection.into_http_response().headers()["etag"], "\"2\"");
//! ```

mod expected;
mod memory;
mod number;
mod outcome;
mod retry;

mod conditional;
#[cfg(feature = "sqlx")]
mod sql;

#[cfg(feature = "axum")]
pub use conditional::RequireIfMatch;
pub use conditional::{
    ETag, ETagList, InvalidETag, InvalidPrecondition, PreconditionRejection, Preconditions,
    INVALID_PRECONDITION_TYPE, NOT_FOUND_TYPE, PRECONDITION_FAILED_TYPE,
    PRECONDITION_REQUIRED_TYPE,
};
pub use expected::Expected;
pub use memory::{MemoryVersioned, Versioned};
pub use number::Version;
pub use outcome::{ConflictReason, InsertOutcome, VersionedUpdate};
pub use retry::{retry_on_conflict, IsConflict, RetryPolicy};

#[cfg(feature = "sqlx")]
pub use sql::{
    commit_if_updated, SetValues, VersionedBackend, VersionedTable, VersionedTableError,
};
