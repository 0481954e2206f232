//! Who waits on which key: the bookkeeping of [`Waiters`](super::Waiters) without its tokio
//! wake-ups, so the shuttle tests can schedule it (its lock and count are `crate::sync`'s).
//!
//! Each key with waiters has one entry holding a value (the real one: the key's watch and its
//! poller) and a count of its subscribers, changed only under the map's lock: the last one
//! out removes the entry and hands its value back, so nothing is left behind however many
//! waiters leave at once.

use std::{
    collections::{hash_map, HashMap},
    sync::PoisonError,
};

use crate::{
    record::StoreKey,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Mutex, MutexGuard,
    },
};

struct Entry<V> {
    subscribers: usize,
    value: V,
    /// The key's digest, under which notifications name it (only while a feed is followed).
    digest: Option<[u8; 32]>,
}

struct Map<V> {
    by_key: HashMap<StoreKey, Entry<V>>,
    /// The keys that have waiters, by digest, for the notifications of the store's feed.
    by_digest: HashMap<[u8; 32], StoreKey>,
}

/// The keys that have waiters, each with its value and subscriber count.
pub(crate) struct Registry<V> {
    map: Mutex<Map<V>>,
    /// The number of keys in `map`, readable without its lock: every owner settling a key
    /// asks for its waiters, and nearly always there are none. Raised before a key's value is
    /// started, so an owner that reads zero settled before that value's poller first looked.
    key_count: AtomicUsize,
}

impl<V> Default for Registry<V> {
    fn default() -> Self {
        Self {
            map: Mutex::new(Map {
                by_key: HashMap::new(),
                by_digest: HashMap::new(),
            }),
            key_count: AtomicUsize::new(0),
        }
    }
}

impl<V> Registry<V> {
    /// Counts one more subscriber of `key` and returns what `subscribe` makes of its value, or
    /// `None` when `max` already wait on it. The first subscriber's `start` makes the value
    /// (under the lock, after the key is counted); `by_digest` also files the key under its
    /// digest.
    pub(crate) fn join<R>(
        &self,
        key: &StoreKey,
        max: usize,
        by_digest: bool,
        start: impl FnOnce() -> V,
        subscribe: impl FnOnce(&V) -> R,
    ) -> Option<R> {
        let mut guard = self.lock();
        let map = &mut *guard;
        let entry = match map.by_key.entry(key.clone()) {
            hash_map::Entry::Occupied(entry) => entry.into_mut(),
            hash_map::Entry::Vacant(vacant) => {
                self.key_count.fetch_add(1, Ordering::SeqCst);
                let digest = by_digest.then(|| key.digest());
                if let Some(digest) = digest {
                    map.by_digest.insert(digest, key.clone());
                }
                let value = start();
                vacant.insert(Entry {
                    subscribers: 0,
                    value,
                    digest,
                })
            }
        };
        if entry.subscribers >= max {
            return None;
        }
        entry.subscribers += 1;
        Some(subscribe(&entry.value))
    }

    /// Counts one subscriber of `key` out; the last one out gets the key's value back (the
    /// key and its digest are forgotten).
    pub(crate) fn leave(&self, key: &StoreKey) -> Option<V> {
        let mut guard = self.lock();
        let map = &mut *guard;
        let hash_map::Entry::Occupied(mut entry) = map.by_key.entry(key.clone()) else {
            return None;
        };
        entry.get_mut().subscribers -= 1;
        if entry.get().subscribers > 0 {
            return None;
        }
        let entry = entry.remove();
        self.key_count.fetch_sub(1, Ordering::SeqCst);
        if let Some(digest) = entry.digest {
            map.by_digest.remove(&digest);
        }
        Some(entry.value)
    }

    /// Runs `wake` on the value of `key`, if it has waiters. Without the lock when no key has
    /// any: the caller's store write came first, so a value started after this read zero
    /// looks at the store after that write.
    pub(crate) fn wake(&self, key: &StoreKey, wake: impl FnOnce(&V)) {
        if self.key_count.load(Ordering::SeqCst) == 0 {
            return;
        }
        if let Some(entry) = self.lock().by_key.get(key) {
            wake(&entry.value);
        }
    }

    /// Runs `wake` on the value of the key filed under `digest`, if it has waiters.
    pub(crate) fn wake_digest(&self, digest: &[u8; 32], wake: impl FnOnce(&V)) {
        let map = self.lock();
        if let Some(entry) = map
            .by_digest
            .get(digest)
            .and_then(|key| map.by_key.get(key))
        {
            wake(&entry.value);
        }
    }

    /// Runs `wake` on the value of every key that has waiters.
    pub(crate) fn wake_all(&self, mut wake: impl FnMut(&V)) {
        for entry in self.lock().by_key.values() {
            wake(&entry.value);
        }
    }

    /// How many keys have waiters right now.
    pub(crate) fn keys(&self) -> usize {
        self.key_count.load(Ordering::SeqCst)
    }

    /// How many keys are filed by key and by digest, under one look at the map (the tests'
    /// check that nothing is left behind).
    #[cfg(all(test, shuttle))]
    pub(crate) fn filed(&self) -> (usize, usize) {
        let map = self.lock();
        (map.by_key.len(), map.by_digest.len())
    }

    fn lock(&self) -> MutexGuard<'_, Map<V>> {
        // Every change under the lock is a single insert, increment, decrement or removal
        // (of a key and its digest together): a panicking holder cannot leave it half-done.
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
