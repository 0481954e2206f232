//! The keys whose owner runs in this process: their duplicates here wait to be woken instead
//! of asking the database.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex, PoisonError},
};

use crate::{engine::Engine, record::StoreKey};

#[derive(Default)]
pub(crate) struct LocalOwners {
    keys: Mutex<HashSet<StoreKey>>,
}

/// This process owns a key until this is dropped; dropping it wakes the key's local waiters.
pub(crate) struct LocalOwnership {
    owners: Arc<LocalOwners>,
    engine: Engine,
    key: StoreKey,
}

impl LocalOwners {
    pub(crate) fn contains(&self, key: &StoreKey) -> bool {
        self.lock().contains(key)
    }

    pub(crate) fn enter(self: &Arc<Self>, engine: &Engine, key: StoreKey) -> LocalOwnership {
        self.lock().insert(key.clone());
        LocalOwnership {
            owners: self.clone(),
            engine: engine.clone(),
            key,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<StoreKey>> {
        // A set of keys holds no invariant a panicking holder could break half-way.
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for LocalOwnership {
    fn drop(&mut self) {
        self.owners.lock().remove(&self.key);
        self.engine.waiters.wake(&self.key);
    }
}
