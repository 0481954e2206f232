//! In-process wake-ups for requests waiting on a key another task of this process is running.
//!
//! A waiter subscribes before it looks at the store, so a completion that lands between its
//! look and its sleep still wakes it. Waiters in other processes are not reached by this; they
//! poll the store with capped backoff (see `Engine::wait`).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError},
};

use tokio::sync::Notify;

use crate::record::StoreKey;

#[derive(Default)]
pub(crate) struct Waiters {
    by_key: Mutex<HashMap<StoreKey, Arc<Notify>>>,
}

/// One waiter's interest in a key; dropping it forgets the key once nobody else waits on it.
pub(crate) struct Subscription<'a> {
    waiters: &'a Waiters,
    key: StoreKey,
    notify: Arc<Notify>,
}

impl Waiters {
    pub(crate) fn subscribe(&self, key: &StoreKey) -> Subscription<'_> {
        let notify = self
            .lock()
            .entry(key.clone())
            .or_insert_with(|| Arc::new(Notify::new()))
            .clone();
        Subscription {
            waiters: self,
            key: key.clone(),
            notify,
        }
    }

    /// Wakes every current waiter on `key` (called after the owner completed or released).
    pub(crate) fn wake(&self, key: &StoreKey) {
        // The entry stays: its subscribers keep waiting on the same `Notify` for the next
        // wake (a released key is taken over by one of them, the rest wait again).
        let notify = self.lock().get(key).cloned();
        if let Some(notify) = notify {
            notify.notify_waiters();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<StoreKey, Arc<Notify>>> {
        // The map holds no invariant a panicking holder could break half-way.
        self.by_key.lock().unwrap_or_else(PoisonError::into_inner)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

impl Subscription<'_> {
    pub(crate) fn notify(&self) -> &Notify {
        &self.notify
    }
}

impl Drop for Subscription<'_> {
    fn drop(&mut self) {
        let mut map = self.waiters.lock();
        // Clones are only made under the lock, so the count is exact here: 2 means only the
        // map and this subscription hold it.
        if let Some(current) = map.get(&self.key) {
            if Arc::ptr_eq(current, &self.notify) && Arc::strong_count(&self.notify) == 2 {
                map.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn wake_reaches_a_subscriber_that_enabled_before_the_wake() {
        let waiters = Waiters::default();
        let key = StoreKey::new("s", "k");
        let sub = waiters.subscribe(&key);
        let notified = sub.notify().notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        waiters.wake(&key);
        tokio::time::timeout(std::time::Duration::from_secs(1), notified)
            .await
            .expect("the waiter was not woken");
    }

    #[test]
    fn the_map_forgets_keys_nobody_waits_on() {
        let waiters = Waiters::default();
        let key = StoreKey::new("s", "k");
        let a = waiters.subscribe(&key);
        let b = waiters.subscribe(&key);
        drop(a);
        assert_eq!(waiters.len(), 1, "b still waits");
        drop(b);
        assert_eq!(waiters.len(), 0);
    }
}
