//! The [`Journal`] contract: where finished steps are recorded under the claim.

use async_trait::async_trait;
use bytes::Bytes;

use super::KeyOwner;
use crate::{
    record::{Fingerprint, StoreKey},
    store::StoreError,
};

/// A journal of finished steps, beside a [`Store`](crate::store::Store)'s records.
///
/// The contract, which `conformance::journal` (feature `conformance`) holds every journal to:
///
/// 1. **`append` is fenced by the claim's token**, like `Store::complete`: it records the
///    entry only while the key's record is in progress under exactly `owner`'s token, and
///    atomically with that check (a takeover of the key either happens before the append,
///    which is then refused with [`StoreError::StaleToken`], or waits until the entry is
///    durable, so the new owner reads it). A fenced-out owner changes nothing.
/// 2. **`entries` reports the live entries of `key` written for `fingerprint`**, whoever
///    appended them (a dead owner's entries are the point). Entries outlive a released claim
///    (the effects they record happened) and expire `retention` after they were written,
///    on the store's clock.
/// 3. **Outputs round-trip byte for byte**; errors stay typed ([`StoreError::Backend`] with
///    the backend's error as source).
#[async_trait]
pub trait Journal: Send + Sync + 'static {
    /// The live entries of `key` written for a request with `fingerprint`: (step, output).
    async fn entries(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
    ) -> Result<Vec<(String, Bytes)>, StoreError>;

    /// Records that `step` finished with `output`, fenced by `owner`'s token.
    async fn append(&self, owner: &KeyOwner, step: &str, output: Bytes) -> Result<(), StoreError>;

    /// Deletes up to `batch` expired entries; returns how many it deleted.
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError>;

    /// Up to `limit` live entries of step `started` whose key holds neither a live claim nor
    /// a live record, and which have no live entry of step `failed` for the same fingerprint:
    /// operations whose owner died before it answered, for a
    /// [`Completer`](super::Completer) to finish.
    ///
    /// The default refuses with [`StoreError::Config`]: a journal that cannot find its keys
    /// without scanning the whole keyspace (Redis) has no completer.
    async fn orphans(
        &self,
        started: &str,
        failed: &str,
        limit: u32,
    ) -> Result<Vec<Orphan>, StoreError> {
        let _ = (started, failed, limit);
        Err(StoreError::Config(
            "this journal cannot list the operations whose owner died; run a completer on a SQL or memory journal".to_owned(),
        ))
    }
}

/// An operation whose owner died, as [`Journal::orphans`] finds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Orphan {
    /// The operation's key.
    pub key: StoreKey,
    /// The fingerprint of the request that started it.
    pub fingerprint: Fingerprint,
    /// The output of its `started` entry.
    pub output: Bytes,
}
