//! [`KeyOwner`]: what a step needs to know about the claim it runs under.

use std::time::Duration;

use crate::{
    engine::{Claim, ClaimStatus},
    record::{hex, FieldHasher, Fingerprint, StoreKey, Token},
};

/// The claim an operation runs under, as its steps see it: the key, the fencing token, the
/// request's fingerprint, how long journal entries are kept, and whether the claim was lost.
///
/// The HTTP layer puts one in the extensions of every request that owns its key;
/// [`Engine::run_steps`](crate::Engine::run_steps) builds one from its claim. Cheap to clone.
#[derive(Clone, Debug)]
pub struct KeyOwner {
    pub(crate) key: StoreKey,
    pub(crate) token: Token,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) retention: Duration,
    pub(crate) status: ClaimStatus,
}

impl KeyOwner {
    /// The owner of `claim`: its key, token and fingerprint, and the engine's retention.
    pub fn of(claim: &Claim) -> Self {
        Self {
            key: claim.key().clone(),
            token: claim.token(),
            fingerprint: claim.fingerprint(),
            retention: claim.retention(),
            status: claim.status(),
        }
    }

    /// The claimed key.
    pub fn key(&self) -> &StoreKey {
        &self.key
    }

    /// The claim's fencing token: a journal appends only while the claim still holds it.
    pub fn token(&self) -> Token {
        self.token
    }

    /// The fingerprint of the request that owns the key: journal entries of another request
    /// under the same key (reused after a release) are not its own.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    /// How long journal entries are kept: the engine's retention of completed records.
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// Whether the claim is still held.
    pub fn status(&self) -> &ClaimStatus {
        &self.status
    }

    /// The idempotency key for step `step`'s call downstream: 64 hex digits of a SHA-256 over
    /// the scope, the key and the step name. Every retry and every process that takes the key
    /// over derives the same one, and two steps, keys or scopes never share one.
    ///
    /// ```
    /// # use tower_idempotency::{steps::KeyOwner, StoreKey};
    /// let key = KeyOwner::derive(&StoreKey::new("alice", "order-7"), "charge");
    /// assert_eq!(key.len(), 64);
    /// assert_ne!(key, KeyOwner::derive(&StoreKey::new("bob", "order-7"), "charge"));
    /// ```
    pub fn derive(key: &StoreKey, step: &str) -> String {
        let mut hasher = FieldHasher::default();
        hasher
            .field(b"tower-idempotency step")
            .field(key.scope().as_bytes())
            .field(key.key().as_bytes())
            .field(step.as_bytes());
        hex(hasher.finish().as_bytes())
    }
}
