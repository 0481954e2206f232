//! The embedded default store: records in sharded hash tables inside this process, within
//! a byte budget.
//!
//! Each key lives in one shard, chosen from its digest; every operation on a key runs under
//! that shard's lock, so a claim reads and writes the record as one step. Records expire at
//! their own deadline (a claim's lease, a completed record's retention) on the store's
//! monotonic clock: an expired record counts as absent at once, and its memory is reclaimed
//! by an incremental sweep that every new record advances, by a full sweep when the budget
//! runs out, or by [`purge_expired`](Store::purge_expired).
//!
//! It referees races between the tasks of one process only. Several processes (replicas
//! behind a load balancer) need a shared store such as Postgres or Redis.

mod budget;
mod shard;
#[cfg(all(test, shuttle))]
mod shuttle_tests;

use std::{
    sync::{Arc, PoisonError},
    time::{Duration, Instant},
};

use async_trait::async_trait;
use bytes::Bytes;

use self::{
    budget::Budget,
    shard::{Digest, Millis, Shard, Slot},
};
use super::{Store, StoreError};
use crate::record::{ClaimOutcome, Fingerprint, Record, StoreKey, Token};
use crate::sync::{Mutex, MutexGuard};

/// How many shards split the records (a power of two). Enough that tasks on different keys
/// rarely wait for each other's lock.
const SHARDS: usize = 16;

/// How many slots each new record's incremental sweep examines. More than one, so the sweep
/// outruns the inserts and every expired record is reached within a pass.
const SWEEP_STEPS: usize = 2;

/// An in-memory [`Store`] that never drops a live record. Clones share the same records.
///
/// ```
/// use tower_idempotency::store::MemoryStore;
/// let store = MemoryStore::builder().max_bytes(64 * 1024 * 1024).build();
/// # let _ = store;
/// ```
///
/// # Memory budget
///
/// The store charges each record its payload (the stored response) plus a fixed
/// [`RECORD_OVERHEAD`](Self::RECORD_OVERHEAD) bytes (16 bytes of its key's SHA-256, a 128-bit
/// identity; the fingerprint, the deadline, the token or payload handle, its index entry), and
/// holds at most
/// [`max_bytes`](MemoryStoreBuilder::max_bytes) of them (default 256 MiB).
///
/// When the budget is used up, a claim on a new key is refused with [`StoreError::Full`]:
/// the layer answers 503 and does not run the handler, and the store logs one warning per
/// episode. A live claim and a completed record within its retention are never evicted to
/// make room, since forgetting either would let a duplicate run again. Completing a claim that
/// was admitted always succeeds, so usage can exceed the budget by the payloads of the claims
/// in flight. Size the budget above (keys per retention window) × (overhead + typical
/// payload); [`used_bytes`](MemoryStore::used_bytes) and
/// [`refused_claims`](MemoryStore::refused_claims) tell how close you are.
///
/// The charge is the store's own accounting, not the allocator's. Measured with
/// `examples/memory_per_record` (1,000,000 completed records of 195 bytes), the process
/// grows by about 291 bytes per record: the payload plus 96 bytes of overhead, a little more
/// than the charge because the allocator rounds the payload's allocation up and adds its
/// header, and the hash table runs partly empty. Behind an HTTP server the allocator's
/// fragmentation adds about 30 bytes more: the `payments` example grows by about 321 bytes
/// per record over a million keys (`scripts/bench`, its 195-byte stored responses).
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    budget: Budget,
    /// Time zero of the store's clock: deadlines are milliseconds since then.
    epoch: Instant,
}

/// Builds a [`MemoryStore`].
#[derive(Debug, Clone)]
pub struct MemoryStoreBuilder {
    max_bytes: u64,
}

impl MemoryStoreBuilder {
    /// The most bytes the records may hold (default 256 MiB), counted as each record's
    /// payload plus [`MemoryStore::RECORD_OVERHEAD`].
    pub fn max_bytes(mut self, bytes: u64) -> Self {
        self.max_bytes = bytes;
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        MemoryStore {
            inner: Arc::new(Inner {
                shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
                budget: Budget::new(self.max_bytes),
                epoch: Instant::now(),
            }),
        }
    }
}

impl Default for MemoryStoreBuilder {
    fn default() -> Self {
        Self {
            max_bytes: 256 * 1024 * 1024,
        }
    }
}

impl MemoryStore {
    /// The bytes charged per record besides its payload.
    pub const RECORD_OVERHEAD: u64 = shard::RECORD_BYTES;

    /// A store with the default budget (256 MiB).
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// A builder to set the budget.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder::default()
    }

    /// How many records the store holds, expired ones not yet reclaimed included.
    pub fn entry_count(&self) -> u64 {
        self.inner.shards.iter().map(|s| lock(s).len() as u64).sum()
    }

    /// The bytes charged for the records held (see [the budget](Self#memory-budget)).
    pub fn used_bytes(&self) -> u64 {
        self.inner.budget.used()
    }

    /// The budget in bytes.
    pub fn max_bytes(&self) -> u64 {
        self.inner.budget.max()
    }

    /// How many claims were refused with [`StoreError::Full`] since the store was built.
    pub fn refused_claims(&self) -> u64 {
        self.inner.budget.refused()
    }

    fn now(&self) -> Millis {
        // A process would have to run for 584 million years to overflow this.
        Millis::try_from(self.inner.epoch.elapsed().as_millis()).unwrap_or(Millis::MAX)
    }

    fn shard(&self, key: &Digest) -> MutexGuard<'_, Shard> {
        // The in-shard hash uses the digest's first bytes; the shard comes from its last.
        lock(&self.inner.shards[usize::from(key[31]) % SHARDS])
    }

    /// Applies `change` to the live claim held by `token`, atomically under the key's lock;
    /// `change` returns the bytes it added to the record.
    fn fenced(
        &self,
        key: &StoreKey,
        token: Token,
        change: impl FnOnce(&mut Slot) -> u64,
    ) -> Result<(), StoreError> {
        let digest = key.digest();
        let now = self.now();
        let mut shard = self.shard(&digest);
        let slot = shard
            .get_claimed(&digest, token, now)
            .ok_or(StoreError::StaleToken)?;
        let added = change(slot);
        let deadline = slot.deadline();
        shard.note_deadline(deadline);
        self.inner.budget.take(added);
        Ok(())
    }

    /// Runs `write` while the key's live claim is held by `token`, under the key's lock: a
    /// takeover of the key comes wholly before (and `write` does not run: a stale token) or
    /// wholly after. The step journal's fence.
    pub(crate) fn while_claimed<T>(
        &self,
        key: &StoreKey,
        token: Token,
        write: impl FnOnce(u64) -> T,
    ) -> Result<T, StoreError> {
        let digest = key.digest();
        let now = self.now();
        let mut shard = self.shard(&digest);
        shard
            .get_claimed(&digest, token, now)
            .ok_or(StoreError::StaleToken)?;
        Ok(write(now))
    }

    /// The store's clock, in milliseconds since it was built.
    pub(crate) fn clock(&self) -> u64 {
        self.now()
    }

    /// Removes expired records from every shard until `limit` are gone; their count.
    fn sweep_all(&self, limit: u64) -> u64 {
        let now = self.now();
        let mut removed = 0;
        for shard in self.inner.shards.iter() {
            if removed == limit {
                break;
            }
            let (count, bytes) = lock(shard).sweep_all(now, limit - removed);
            self.inner.budget.give_back(bytes);
            removed += count;
        }
        removed
    }

    /// One attempt at a claim under the shard's lock; `Ok(None)` when the budget is used up.
    fn try_claim(
        &self,
        digest: Digest,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        let now = self.now();
        let deadline = deadline(now, lease, "lease")?;
        let budget = &self.inner.budget;
        let mut shard = self.shard(&digest);
        // Issued before knowing whether it is needed: a sequence number skipped costs nothing.
        let (token, sequence) = shard.issue_token();
        if let Some(slot) = shard.get_mut(&digest) {
            if slot.is_live(now) {
                return Ok(Some(ClaimOutcome::Existing(slot.record())));
            }
            // Taking over an expired record reuses its slot: it needs no new room.
            let freed = slot.charge();
            *slot = Slot::claim(digest, *fingerprint, sequence, deadline);
            budget.give_back(freed - slot.charge());
            shard.note_deadline(deadline);
            return Ok(Some(ClaimOutcome::Claimed(token)));
        }
        let (_, freed) = shard.sweep_some(now, SWEEP_STEPS);
        budget.give_back(freed);
        if shard.is_at_index_limit() || !budget.try_take(Self::RECORD_OVERHEAD) {
            return Ok(None);
        }
        shard.insert(Slot::claim(digest, *fingerprint, sequence, deadline));
        Ok(Some(ClaimOutcome::Claimed(token)))
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // Nothing under the lock calls foreign code; a panic there leaves the shard consistent.
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `now + duration` in whole milliseconds (rounded up, so a sub-millisecond lease is not
/// already over); a duration the clock cannot hold is a configuration error, not a panic.
fn deadline(now: Millis, duration: Duration, what: &str) -> Result<Millis, StoreError> {
    Millis::try_from(duration.as_nanos().div_ceil(1_000_000))
        .ok()
        .and_then(|millis| now.checked_add(millis))
        .ok_or_else(|| {
            StoreError::Config(format!(
                "a {what} of {duration:?} is longer than the memory store's clock can hold \
                 (about 584 million years); use a finite {what}"
            ))
        })
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("used_bytes", &self.used_bytes())
            .field("max_bytes", &self.max_bytes())
            .finish_non_exhaustive()
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
        let digest = key.digest();
        if let Some(outcome) = self.try_claim(digest, fingerprint, lease)? {
            return Ok(outcome);
        }
        // Full: reclaim what has expired anywhere (a no-op for shards where nothing can
        // have), then decide again under the lock, since the key may have been claimed since.
        if self.sweep_all(u64::MAX) > 0 {
            if let Some(outcome) = self.try_claim(digest, fingerprint, lease)? {
                return Ok(outcome);
            }
        }
        let budget = &self.inner.budget;
        budget.refuse();
        Err(StoreError::Full {
            used_bytes: budget.used(),
            max_bytes: budget.max(),
        })
    }

    async fn renew(&self, key: &StoreKey, token: Token, lease: Duration) -> Result<(), StoreError> {
        let deadline = deadline(self.now(), lease, "lease")?;
        self.fenced(key, token, |slot| {
            slot.renew(deadline);
            0
        })
    }

    async fn complete(
        &self,
        key: &StoreKey,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let deadline = deadline(self.now(), retention, "retention")?;
        // A copy, so the record holds exactly its payload (a slice of a larger buffer would
        // keep all of that buffer alive, unseen by the budget), made before taking the shard's
        // lock: other keys of the shard need not wait for an allocation and a copy.
        let payload = Box::from(&payload[..]);
        self.fenced(key, token, |slot| slot.complete(payload, deadline))
    }

    async fn release(&self, key: &StoreKey, token: Token) -> Result<(), StoreError> {
        let digest = key.digest();
        let now = self.now();
        let mut shard = self.shard(&digest);
        if shard.get_claimed(&digest, token, now).is_none() {
            return Err(StoreError::StaleToken);
        }
        let freed = shard.remove(&digest).unwrap_or(0);
        self.inner.budget.give_back(freed);
        Ok(())
    }

    async fn lookup(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        let digest = key.digest();
        let now = self.now();
        let mut shard = self.shard(&digest);
        Ok(shard
            .get_mut(&digest)
            .filter(|slot| slot.is_live(now))
            .map(|slot| slot.record()))
    }

    async fn forget(&self, key: &StoreKey) -> Result<bool, StoreError> {
        let digest = key.digest();
        let freed = self.shard(&digest).remove(&digest);
        if let Some(freed) = freed {
            self.inner.budget.give_back(freed);
        }
        Ok(freed.is_some())
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        Ok(self.sweep_all(u64::from(batch)))
    }
}
