//! The step journal of the [`MemoryStore`]: one process, foreign calls only.

use std::{collections::HashMap, sync::Arc, time::Duration};

use async_trait::async_trait;
use bytes::Bytes;

use super::{Journal, KeyOwner};
use crate::{
    record::{Fingerprint, StoreKey},
    store::{MemoryStore, StoreError},
    sync::Mutex,
};

/// A journal of steps beside a [`MemoryStore`], for operations whose steps are foreign calls
/// (there is no database for a local phase). An entry is appended under the key's lock in the
/// store, so a takeover of the key comes wholly before it (the entry is refused) or after it.
/// Entries live as long as the store's retention says, outside its byte budget; purge them
/// with [`Journal::purge_expired`]. Clones share the entries.
#[derive(Clone, Debug)]
pub struct MemoryJournal {
    store: MemoryStore,
    entries: Arc<Mutex<HashMap<(StoreKey, String), Entry>>>,
}

#[derive(Debug)]
struct Entry {
    fingerprint: Fingerprint,
    output: Bytes,
    /// On the store's clock.
    expires_at: u64,
}

impl MemoryJournal {
    /// The journal of `store`'s keys (a clone of the store: they share the records).
    pub fn for_store(store: &MemoryStore) -> Self {
        Self {
            store: store.clone(),
            entries: Arc::default(),
        }
    }

    fn entries_map(&self) -> crate::sync::MutexGuard<'_, HashMap<(StoreKey, String), Entry>> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[async_trait]
impl Journal for MemoryJournal {
    async fn entries(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        let now = self.store.clock();
        Ok(self
            .entries_map()
            .iter()
            .filter(|((k, _), e)| k == key && e.fingerprint == *fingerprint && e.expires_at > now)
            .map(|((_, step), e)| (step.clone(), e.output.clone()))
            .collect())
    }

    async fn append(&self, owner: &KeyOwner, step: &str, output: Bytes) -> Result<(), StoreError> {
        self.store.while_claimed(&owner.key, owner.token, |now| {
            let entry = Entry {
                fingerprint: owner.fingerprint,
                output,
                expires_at: now.saturating_add(millis(owner.retention)),
            };
            self.entries_map()
                .insert((owner.key.clone(), step.to_owned()), entry);
        })
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let now = self.store.clock();
        let mut entries = self.entries_map();
        let expired: Vec<_> = entries
            .iter()
            .filter(|(_, e)| e.expires_at <= now)
            .map(|(k, _)| k.clone())
            .take(batch as usize)
            .collect();
        for key in &expired {
            entries.remove(key);
        }
        Ok(expired.len() as u64)
    }
}

#[cfg(all(test, shuttle))]
mod shuttle_tests;
