use crate::BoxError;

/// Why a [`Store`](super::Store) operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The token no longer owns the record: the lease ran out and another request took the key
    /// over, or the record was completed, released or purged. Nothing was changed. An owner
    /// that sees this must not store its outcome; renew leases more often than they expire.
    #[error("the claim is no longer held by this token (its lease ran out and the key was taken over, or it was completed or released); nothing was changed")]
    StaleToken,

    /// The backend failed or could not be reached. The source is the backend's own error
    /// (for example `sqlx::Error` or `redis::RedisError`): downcast it for details.
    #[error("the {backend} idempotency store failed; check that it is reachable and its schema is migrated")]
    Backend {
        /// Which backend failed (`"postgres"`, `"redis"`, ...).
        backend: &'static str,
        /// The backend's error.
        #[source]
        source: BoxError,
    },

    /// The store did not answer within the engine's time limit (a network that went silent,
    /// a stuck server). The operation may or may not have taken effect; an unanswered claim
    /// that did commit ends with its lease, like the claim of an owner that died.
    #[error("the idempotency store did not answer within {after:?}; check that it is reachable")]
    Timeout {
        /// The limit that passed.
        after: std::time::Duration,
    },

    /// The connection broke after a `COMMIT` was sent (an I/O or protocol error, the server
    /// ending the session): the transaction may or may not have committed. Nothing here can
    /// tell which; the next request with the key learns it (a committed record is replayed,
    /// a key with no record runs once). The source is the backend's own error.
    #[error("the connection to the {backend} idempotency store broke during the commit; the transaction may or may not have committed")]
    CommitOutcomeUnknown {
        /// Which backend failed (`"postgres"`, `"mysql"`, ...).
        backend: &'static str,
        /// The backend's error.
        #[source]
        source: BoxError,
    },

    /// A stored record could not be decoded: it was written by something else or is damaged.
    #[error("the {backend} idempotency store holds a record it cannot read: {detail}")]
    Corrupt {
        /// Which backend holds the record.
        backend: &'static str,
        /// What was wrong with it.
        detail: String,
    },

    /// The store has no room for another record: its byte budget is held by live claims and
    /// completed records within their retention, none of which it may drop. Nothing was
    /// stored and no handler should run; answer "service unavailable" and let the client
    /// retry once records expire.
    #[error("the idempotency store is full ({used_bytes} of {max_bytes} bytes held by live claims and unexpired records); nothing was stored: retry later, raise the store's byte budget or shorten the retention")]
    Full {
        /// Bytes charged when the claim was refused.
        used_bytes: u64,
        /// The budget.
        max_bytes: u64,
    },

    /// The store was configured with a value it cannot use (a table name, a lease too long
    /// for the backend, ...).
    #[error("invalid idempotency store configuration: {0}")]
    Config(String),

    /// A Redis store was opened with a key prefix it refuses; nothing was connected. The
    /// source says which prefix and why, as [`RedisStoreBuilder::build`] would.
    ///
    /// [`RedisStoreBuilder::build`]: super::RedisStoreBuilder::build
    #[cfg(feature = "redis")]
    #[error(transparent)]
    InvalidPrefix(#[from] super::InvalidPrefix),

    /// A Redis store was opened on a node whose `maxmemory-policy` may evict records (it is
    /// not `noeviction`), and the store was told to refuse that (the default). It carries
    /// the node and its policy; see
    /// [`RedisStoreBuilder::on_evicting_policy`](super::RedisStoreBuilder::on_evicting_policy).
    #[cfg(feature = "redis")]
    #[error(transparent)]
    EvictingPolicy(#[from] super::EvictingPolicy),
}

impl StoreError {
    /// Wraps a backend error, keeping it as the source.
    pub fn backend(backend: &'static str, source: impl Into<BoxError>) -> Self {
        StoreError::Backend {
            backend,
            source: source.into(),
        }
    }

    /// True when the error says the store could not do its job at all (rather than a
    /// lost fence), i.e. when a caller should answer "service unavailable".
    pub fn is_unavailable(&self) -> bool {
        !matches!(self, StoreError::StaleToken)
    }
}
