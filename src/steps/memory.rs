//! The step journal of the [`MemoryStore`]: one process, foreign calls only.

use std::{collections::HashMap, sync::Arc, time::Duration};

use async_trait::async_trait;
use bytes::Bytes;

use super::{Journal, KeyOwner, Orphan};
use crate::{
    record::{Fingerprint, StoreKey},
    store::{MemoryStore, Store, StoreError},
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
    entries: Arc<Mutex<HashMap<StoreKey, HashMap<String, Entry>>>>,
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

    fn entries_map(
        &self,
    ) -> crate::sync::MutexGuard<'_, HashMap<StoreKey, HashMap<String, Entry>>> {
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
        Ok(self.entries_map().get(key).map_or_else(Vec::new, |steps| {
            steps
                .iter()
                .filter(|(_, e)| e.fingerprint == *fingerprint && e.expires_at > now)
                .map(|(step, e)| (step.clone(), e.output.clone()))
                .collect()
        }))
    }

    async fn append(&self, owner: &KeyOwner, step: &str, output: Bytes) -> Result<(), StoreError> {
        self.store.while_claimed(&owner.key, owner.token, |now| {
            let entry = Entry {
                fingerprint: owner.fingerprint,
                output,
                expires_at: now.saturating_add(millis(owner.retention)),
            };
            self.entries_map()
                .entry(owner.key.clone())
                .or_default()
                .insert(step.to_owned(), entry);
        })
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let now = self.store.clock();
        let mut purged = 0;
        self.entries_map().retain(|_, steps| {
            steps.retain(|_, e| {
                let keep = e.expires_at > now || purged == u64::from(batch);
                purged += u64::from(!keep);
                keep
            });
            !steps.is_empty()
        });
        Ok(purged)
    }

    async fn orphans(
        &self,
        started: &str,
        failed: &str,
        limit: u32,
    ) -> Result<Vec<Orphan>, StoreError> {
        let now = self.store.clock();
        let live = |e: &&Entry| e.expires_at > now;
        let candidates: Vec<Orphan> = self
            .entries_map()
            .iter()
            .filter_map(|(key, steps)| {
                let start = steps.get(started).filter(live)?;
                let gave_up = steps
                    .get(failed)
                    .filter(live)
                    .is_some_and(|f| f.fingerprint == start.fingerprint);
                (!gave_up).then(|| Orphan {
                    key: key.clone(),
                    fingerprint: start.fingerprint,
                    output: start.output.clone(),
                })
            })
            .collect();
        let mut orphans = Vec::new();
        for orphan in candidates {
            if orphans.len() == usize::try_from(limit).unwrap_or(usize::MAX) {
                break;
            }
            if self.store.lookup(&orphan.key).await?.is_none() {
                orphans.push(orphan);
            }
        }
        Ok(orphans)
    }
}

#[cfg(all(test, shuttle))]
mod shuttle_tests;
