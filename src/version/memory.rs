use std::{collections::HashMap, hash::Hash, sync::Arc};

use super::{ConflictReason, Expected, InsertOutcome, Version, VersionedUpdate};
use crate::sync::{Mutex, MutexGuard};

/// A value together with its version, as read from a [`MemoryVersioned`] map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned<V> {
    /// The version of `value`.
    pub version: Version,
    /// The value.
    pub value: V,
}

/// An in-process map of versioned rows with the same compare-and-set semantics as
/// `VersionedTable` over SQL: for tests and for applications that
/// keep their data in memory.
///
/// Each operation holds one lock for its whole check-and-write, so the compare and the set
/// cannot be separated by another writer. Clones share the same map.
///
/// ```
/// use tower_idempotency::version::{MemoryVersioned, Version, VersionedUpdate};
/// let payments = MemoryVersioned::new();
/// let _ = payments.insert_new(1, "pending");
/// let won = payments.update_if_version(&1, Version::INITIAL, |status| *status = "paid");
/// assert!(matches!(won, VersionedUpdate::Updated { version, .. } if version.get() == 2));
/// // A second writer still holding version 1 loses and learns the current version.
/// let lost = payments.update_if_version(&1, Version::INITIAL, |status| *status = "failed");
/// assert!(matches!(lost, VersionedUpdate::Conflict { current_version: Some(v), .. } if v.get() == 2));
/// assert!(matches!(payments.update_if_version(&9, Version::INITIAL, |_| {}), VersionedUpdate::NotFound));
/// ```
#[derive(Debug)]
pub struct MemoryVersioned<K, V> {
    rows: Arc<Mutex<HashMap<K, Versioned<V>>>>,
}

impl<K, V> Clone for MemoryVersioned<K, V> {
    fn clone(&self) -> Self {
        Self {
            rows: Arc::clone(&self.rows),
        }
    }
}

impl<K, V> Default for MemoryVersioned<K, V> {
    fn default() -> Self {
        Self {
            rows: Arc::default(),
        }
    }
}

impl<K: Eq + Hash, V: Clone> MemoryVersioned<K, V> {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// The current value and version under `key`.
    pub fn get(&self, key: &K) -> Option<Versioned<V>> {
        self.lock().get(key).cloned()
    }

    /// Inserts `value` at [`Version::INITIAL`] unless `key` is present (create-only).
    pub fn insert_new(&self, key: K, value: V) -> InsertOutcome {
        let mut rows = self.lock();
        if rows.contains_key(&key) {
            return InsertOutcome::AlreadyExists { constraint: None };
        }
        rows.insert(
            key,
            Versioned {
                version: Version::INITIAL,
                value,
            },
        );
        InsertOutcome::Created {
            version: Version::INITIAL,
        }
    }

    /// If the value under `key` is at a version `expected` accepts, applies `change` to it
    /// and raises the version by one, under one lock. The updated value is returned as the
    /// row; on a conflict, the current value and version are.
    pub fn update_if_version(
        &self,
        key: &K,
        expected: impl Into<Expected>,
        change: impl FnOnce(&mut V),
    ) -> VersionedUpdate<V> {
        let expected = expected.into();
        let mut rows = self.lock();
        let Some(row) = rows.get_mut(key) else {
            return VersionedUpdate::NotFound;
        };
        if !expected.accepts(row.version) {
            return VersionedUpdate::Conflict {
                current_version: Some(row.version),
                row: Some(row.value.clone()),
                reason: ConflictReason::VersionMismatch,
            };
        }
        // Work on a copy so that a panicking `change` leaves the stored row untouched.
        let mut value = row.value.clone();
        change(&mut value);
        row.value = value;
        row.version = row.version.next();
        VersionedUpdate::Updated {
            version: row.version,
            row: Some(row.value.clone()),
        }
    }

    /// Removes `key`, returning what was there.
    pub fn remove(&self, key: &K) -> Option<Versioned<V>> {
        self.lock().remove(key)
    }

    /// The number of rows.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// True when there are no rows.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<K, Versioned<V>>> {
        // A panic while the lock was held cannot have left a half-written row (see
        // `update_if_version`), so a poisoned lock is safe to keep using.
        self.rows
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
