use std::time::Duration;

use crate::store::StoreError;

/// Why the engine would not run or replay an operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The key was first used with a different request (fingerprint). Reusing a key for a new
    /// request is a client bug: send a new key.
    #[error("this idempotency key was already used with a different request; use a new key for a new request")]
    FingerprintMismatch,

    /// The first request with this key is still running (and the policy is to reject, or the
    /// wait timed out). Retry after `retry_after`.
    #[error(
        "a request with this idempotency key is still being processed; retry after {retry_after:?}"
    )]
    InProgress {
        /// A suggested delay before retrying.
        retry_after: Duration,
    },

    /// The database is busy with other requests' writes (one writer at a time, as on
    /// SQLite) and this request's turn did not come within its wait; nothing was run. The
    /// store is healthy: retry after `retry_after`.
    #[error("the database is busy with other requests' writes; nothing was run, retry after {retry_after:?}")]
    Busy {
        /// A suggested delay before retrying.
        retry_after: Duration,
    },

    /// The store failed; nothing was run. Retry after `retry_after`.
    #[error("the idempotency store is unavailable; nothing was run, retry after {retry_after:?}")]
    Store {
        /// A suggested delay before retrying.
        retry_after: Duration,
        /// The store's error.
        #[source]
        source: StoreError,
    },

    /// The store holds a record under this key that it cannot read
    /// ([`StoreError::Corrupt`]): damaged, or written by something else. The operation it
    /// belongs to may have run, so this one was not; retrying cannot help until an operator
    /// removes the record with [`Store::forget`](crate::store::Store::forget).
    #[error("the record stored under this idempotency key cannot be read; nothing was run, and the key stays unusable until an operator forgets its record")]
    Unreadable {
        /// The store's error ([`StoreError::Corrupt`]).
        #[source]
        source: StoreError,
    },
}

/// Why [`Engine::run_once`](super::Engine::run_once) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError<E> {
    /// The operation was not run (duplicate still running, key reused, store down).
    #[error(transparent)]
    Engine(#[from] EngineError),

    /// The operation ran and failed; its claim was released so a retry runs it again.
    #[error("the operation failed; its claim was released so that a retry runs it again")]
    Operation(#[source] E),

    /// The operation succeeded but its outcome could not be recorded after several attempts.
    /// Until the claim's lease runs out duplicates wait or are rejected; after that a
    /// duplicate would run the operation again. `output` is the outcome that was not recorded.
    #[error("the operation succeeded but its outcome could not be recorded; a duplicate arriving after the lease expires will run it again")]
    NotRecorded {
        /// What the operation returned.
        output: bytes::Bytes,
        /// The store's last error.
        #[source]
        source: crate::store::StoreError,
    },
}
