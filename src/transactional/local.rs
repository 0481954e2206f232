//! The keys a task of this process is claiming or running: their duplicates here wait to be
//! woken instead of asking the database, so a burst of copies costs one claim.

use std::{
    collections::HashSet,
    sync::{Arc, PoisonError},
};

use crate::{
    engine::{in_flight::InFlightGuard, Engine},
    record::StoreKey,
    sync::{Mutex, MutexGuard},
};

#[derive(Default)]
pub(crate) struct LocalOwners {
    keys: Mutex<HashSet<StoreKey>>,
}

/// A task of this process claims (then owns) a key until this is dropped; dropping it wakes
/// the key's local waiters. It also counts as in flight for `Engine::drained`.
pub(crate) struct LocalOwnership {
    owners: Arc<LocalOwners>,
    engine: Engine,
    key: StoreKey,
    _in_flight: InFlightGuard,
}

impl LocalOwners {
    /// Marks `key` as claimed by the caller, unless another task of this process has it.
    pub(crate) fn try_enter(
        self: &Arc<Self>,
        engine: &Engine,
        key: &StoreKey,
    ) -> Option<LocalOwnership> {
        if !self.lock().insert(key.clone()) {
            return None;
        }
        Some(LocalOwnership {
            owners: self.clone(),
            engine: engine.clone(),
            key: key.clone(),
            _in_flight: engine.shared.in_flight.enter(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashSet<StoreKey>> {
        // A set of keys holds no invariant a panicking holder could break half-way.
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for LocalOwnership {
    fn drop(&mut self) {
        self.owners.lock().remove(&self.key);
        self.engine.shared.waiters.wake(&self.key);
    }
}
