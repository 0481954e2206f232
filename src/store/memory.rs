//! The embedded default store: records in a bounded [moka] cache inside this process.
//!
//! Atomicity comes from moka's `and_compute_with`, which runs the decision for one key under
//! that key's lock: a claim reads and writes the entry as one step. Each record expires at its
//! own deadline (a claim's lease, a completed record's retention) through moka's per-entry
//! expiry, so the cache never returns an expired record and frees it without a purger.
//!
//! It referees races between the tasks of one process only. Several processes (replicas
//! behind a load balancer) need a shared store such as Postgres or Redis.

use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use moka::{ops::compute::Op, sync::Cache, Expiry};

use super::{Store, StoreError};
use crate::record::{ClaimOutcome, Fingerprint, Record, StoreKey, Token};

/// An in-memory [`Store`] on a bounded moka cache. Clones share the same records.
///
/// ```
/// use tower_idempotency::store::MemoryStore;
/// let store = MemoryStore::builder().max_capacity(100_000).build();
/// # let _ = store;
/// ```
///
/// # Capacity
///
/// When the cache is full, moka evicts records it deems least valuable; an evicted record is
/// forgotten exactly as if its retention had ended, so a later duplicate runs again. Size
/// `max_capacity` above the number of keys you receive within the retention window.
#[derive(Clone)]
pub struct MemoryStore {
    cache: Cache<StoreKey, Entry>,
}

/// Builds a [`MemoryStore`].
#[derive(Debug, Clone)]
pub struct MemoryStoreBuilder {
    max_capacity: u64,
}

#[derive(Clone)]
struct Entry {
    fingerprint: Fingerprint,
    state: State,
    /// The lease's end for a claim, the retention's end for a completed record.
    deadline: Instant,
}

#[derive(Clone)]
enum State {
    InProgress(Token),
    Completed(Bytes),
}

impl Entry {
    fn is_live(&self, now: Instant) -> bool {
        self.deadline > now
    }

    fn record(&self) -> Record {
        match &self.state {
            State::InProgress(_) => Record::InProgress {
                fingerprint: self.fingerprint,
            },
            State::Completed(payload) => Record::Completed {
                fingerprint: self.fingerprint,
                payload: payload.clone(),
            },
        }
    }

    fn is_claimed_by(&self, token: Token, now: Instant) -> bool {
        self.is_live(now) && matches!(self.state, State::InProgress(held) if held == token)
    }
}

/// moka asks this for each entry's lifetime: it is exactly the record's own deadline.
struct DeadlineExpiry;

impl Expiry<StoreKey, Entry> for DeadlineExpiry {
    fn expire_after_create(&self, _: &StoreKey, entry: &Entry, now: Instant) -> Option<Duration> {
        Some(entry.deadline.saturating_duration_since(now))
    }

    fn expire_after_update(
        &self,
        _: &StoreKey,
        entry: &Entry,
        now: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(entry.deadline.saturating_duration_since(now))
    }
}

impl MemoryStoreBuilder {
    /// The most records kept at once (default 1,000,000).
    pub fn max_capacity(mut self, records: u64) -> Self {
        self.max_capacity = records;
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        MemoryStore {
            cache: Cache::builder()
                .name("tower-idempotency")
                .max_capacity(self.max_capacity)
                .expire_after(DeadlineExpiry)
                .build(),
        }
    }
}

impl Default for MemoryStoreBuilder {
    fn default() -> Self {
        Self {
            max_capacity: 1_000_000,
        }
    }
}

impl MemoryStore {
    /// A store with the default capacity (1,000,000 records).
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// A builder to set the capacity.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder::default()
    }

    /// How many records the cache holds right now (approximate: moka updates it lazily).
    pub fn entry_count(&self) -> u64 {
        self.cache.entry_count()
    }

    /// Applies `change` to the live claim held by `token`, atomically under the key's lock.
    async fn fenced(
        &self,
        key: &StoreKey,
        token: Token,
        change: impl FnOnce(Entry) -> Op<Entry>,
    ) -> Result<(), StoreError> {
        let mut held = false;
        self.cache.entry_by_ref(key).and_compute_with(|current| {
            let now = Instant::now();
            match current.map(|e| e.into_value()) {
                Some(entry) if entry.is_claimed_by(token, now) => {
                    held = true;
                    change(entry)
                }
                _ => Op::Nop,
            }
        });
        if held {
            Ok(())
        } else {
            Err(StoreError::StaleToken)
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("entries", &self.cache.entry_count())
            .finish()
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn claim(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        let token = Token::random();
        let mut outcome = ClaimOutcome::Claimed(token);
        self.cache.entry_by_ref(key).and_compute_with(|current| {
            let now = Instant::now();
            match current.map(|e| e.into_value()) {
                Some(entry) if entry.is_live(now) => {
                    outcome = ClaimOutcome::Existing(entry.record());
                    Op::Nop
                }
                _ => Op::Put(Entry {
                    fingerprint: *fingerprint,
                    state: State::InProgress(token),
                    deadline: now + lease,
                }),
            }
        });
        Ok(outcome)
    }

    async fn renew(&self, key: &StoreKey, token: Token, lease: Duration) -> Result<(), StoreError> {
        self.fenced(key, token, |entry| {
            Op::Put(Entry {
                deadline: Instant::now() + lease,
                ..entry
            })
        })
        .await
    }

    async fn complete(
        &self,
        key: &StoreKey,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<(), StoreError> {
        self.fenced(key, token, |entry| {
            Op::Put(Entry {
                fingerprint: entry.fingerprint,
                state: State::Completed(payload),
                deadline: Instant::now() + retention,
            })
        })
        .await
    }

    async fn release(&self, key: &StoreKey, token: Token) -> Result<(), StoreError> {
        self.fenced(key, token, |_| Op::Remove).await
    }

    async fn lookup(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        let now = Instant::now();
        Ok(self
            .cache
            .get(key)
            .filter(|entry| entry.is_live(now))
            .map(|entry| entry.record()))
    }

    async fn purge_expired(&self, _batch: u32) -> Result<u64, StoreError> {
        // moka already hides expired entries and evicts them on its housekeeping passes; this
        // runs a pass now. The count is what the pass removed, as moka reports it, and may
        // include records evicted for capacity.
        let before = self.cache.entry_count();
        self.cache.run_pending_tasks();
        Ok(before.saturating_sub(self.cache.entry_count()))
    }
}
