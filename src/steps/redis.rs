//! The step journal of the [`RedisStore`]: foreign calls only, on one server or a cluster.

use async_trait::async_trait;
use bytes::Bytes;

use super::{Journal, KeyOwner};
use crate::{
    record::{Fingerprint, StoreKey},
    store::{InvalidPrefix, JournalSlot, RedisStore, StoreError},
};

/// A journal of steps beside a [`RedisStore`], for operations whose steps are foreign calls
/// (Redis holds no local phase). Clones share the connection.
///
/// A key's entries are one hash, `{<record key>}:steps` (or `<record key>:steps` when the
/// prefix carries a hash tag): on a Redis Cluster it lives in its record's slot, so one
/// script checks the claim's token and writes the entry atomically, as the store's fenced
/// `complete` does. A takeover of the key comes wholly before the entry (which is refused)
/// or after it (and reads it).
///
/// The hash expires `retention` after its latest entry (Redis 7.0 expires keys, not hash
/// fields), so a key's entries expire together; Redis deletes them itself, and
/// [`Journal::purge_expired`] has nothing to do.
///
/// An entry is not waited on by replicas (the store's `wait_for_replicas` covers claims): a
/// failover that loses one makes the next attempt call that step again, with the same
/// derived key, as after a crash between the call and its entry.
///
/// ```no_run
/// use tower_idempotency::{steps::RedisJournal, store::RedisStore};
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::open("redis://127.0.0.1/").await?;
/// let journal = RedisJournal::for_store(&store)?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct RedisJournal {
    store: RedisStore,
    slot: JournalSlot,
}

impl RedisJournal {
    /// The journal of `store`'s keys (a clone of the store: they share the connection).
    /// Fails on a key prefix with a `}` outside a hash tag, for which no journal key could
    /// share its record's cluster slot: choose a prefix without one.
    pub fn for_store(store: &RedisStore) -> Result<Self, InvalidPrefix> {
        Ok(Self {
            store: store.clone(),
            slot: store.journal_slot()?,
        })
    }

    /// The Redis key `key`'s entries live under (a hash: step -> fingerprint and output).
    pub fn redis_key(&self, key: &StoreKey) -> String {
        self.store.journal_key(self.slot, key)
    }
}

#[async_trait]
impl Journal for RedisJournal {
    async fn entries(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        let entries = self.store.journal_entries(self.slot, key).await?;
        let mut own = Vec::with_capacity(entries.len());
        for (step, entry) in entries {
            // An entry is the fingerprint of the request that wrote it, then the output.
            let Some(output) = entry.strip_prefix(fingerprint.as_bytes().as_slice()) else {
                continue;
            };
            let step = String::from_utf8(step).map_err(|e| StoreError::Corrupt {
                backend: "redis",
                detail: format!("a step name in {} is not UTF-8: {e}", self.redis_key(key)),
            })?;
            own.push((step, Bytes::copy_from_slice(output)));
        }
        Ok(own)
    }

    async fn append(&self, owner: &KeyOwner, step: &str, output: Bytes) -> Result<(), StoreError> {
        let entry = [owner.fingerprint.as_bytes().as_slice(), &output].concat();
        self.store
            .journal_append(
                self.slot,
                &owner.key,
                owner.token,
                step,
                &entry,
                owner.retention,
            )
            .await
    }

    async fn purge_expired(&self, _batch: u32) -> Result<u64, StoreError> {
        // The hashes carry their own expiry (see the type's docs).
        Ok(0)
    }
}
