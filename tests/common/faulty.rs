//! A fault-injecting wrapper around a REAL store: every call goes to the wrapped store, and the
//! test decides which calls fail, hang, or lose their answer. It counts lookups and renewals so
//! a test can measure what the engine asked of the store. Nothing is simulated: a call that is
//! not failed is the real backend's.
#![allow(dead_code)]

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use async_trait::async_trait;
use bytes::Bytes;
use tower_idempotency::{
    store::{Store, StoreError},
    ClaimOutcome, Fingerprint, Record, StoreKey, Token,
};

/// What to do to the next calls. Shared by every clone of the [`Faulty`] store.
#[derive(Default)]
pub struct Faults {
    /// Every call fails without reaching the store (a store that is down).
    pub down: AtomicBool,
    /// The next n renewals fail at once.
    pub fail_renewals: AtomicUsize,
    /// The next n renewals hang (until the engine's store timeout gives up on them).
    pub hang_renewals: AtomicUsize,
    /// The next n completes are committed, then reported as failed (the answer was lost).
    pub lose_complete_answers: AtomicUsize,
    /// Every call waits this long before reaching the store (a slow store), in ms.
    pub delay_ms: AtomicU64,
    /// Lookups that reached the store.
    pub lookups: AtomicUsize,
    /// Renewals that reached the store.
    pub renewals: AtomicUsize,
}

impl Faults {
    fn take(counter: &AtomicUsize) -> bool {
        counter
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    pub fn lookups(&self) -> usize {
        self.lookups.load(Ordering::SeqCst)
    }

    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }
}

/// The wrapped store and its faults.
#[derive(Clone)]
pub struct Faulty {
    pub inner: Arc<dyn Store>,
    pub faults: Arc<Faults>,
}

impl Faulty {
    pub fn new(inner: Arc<dyn Store>) -> Self {
        Self {
            inner,
            faults: Arc::default(),
        }
    }

    async fn gate(&self) -> Result<(), StoreError> {
        let delay = self.faults.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if self.faults.down.load(Ordering::SeqCst) {
            return Err(injected("the store is down"));
        }
        Ok(())
    }
}

fn injected(what: &str) -> StoreError {
    StoreError::backend("faulty", std::io::Error::other(format!("injected: {what}")))
}

#[async_trait]
impl Store for Faulty {
    async fn claim(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        self.gate().await?;
        self.inner.claim(key, fingerprint, lease).await
    }

    async fn renew(&self, key: &StoreKey, token: Token, lease: Duration) -> Result<(), StoreError> {
        self.gate().await?;
        if Faults::take(&self.faults.fail_renewals) {
            return Err(injected("renewal failed"));
        }
        if Faults::take(&self.faults.hang_renewals) {
            std::future::pending::<()>().await;
        }
        self.faults.renewals.fetch_add(1, Ordering::SeqCst);
        self.inner.renew(key, token, lease).await
    }

    async fn complete(
        &self,
        key: &StoreKey,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<(), StoreError> {
        self.gate().await?;
        self.inner.complete(key, token, payload, retention).await?;
        if Faults::take(&self.faults.lose_complete_answers) {
            return Err(injected("the answer to a committed complete was lost"));
        }
        Ok(())
    }

    async fn release(&self, key: &StoreKey, token: Token) -> Result<(), StoreError> {
        self.gate().await?;
        self.inner.release(key, token).await
    }

    async fn lookup(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        self.gate().await?;
        self.faults.lookups.fetch_add(1, Ordering::SeqCst);
        self.inner.lookup(key).await
    }

    async fn forget(&self, key: &StoreKey) -> Result<bool, StoreError> {
        self.gate().await?;
        self.inner.forget(key).await
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        self.gate().await?;
        self.inner.purge_expired(batch).await
    }
}
