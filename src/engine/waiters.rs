//! The requests of this process that wait on a key another request is running, and the one
//! store watch they share.
//!
//! However many duplicates wait on a key, the process looks the key up with one polling task
//! (capped exponential backoff, woken at once when an owner in this process settles the key)
//! and hands every result to all of them through a `watch` channel. The entry of a key counts
//! its subscribers explicitly, under the map's lock: the last one out removes the entry and
//! stops the poller, so nothing is left behind however many waiters leave at once.
//!
//! When the store notifies completions ([`Store::completions`](crate::store::Store::completions)),
//! one task per process follows that feed and pokes the watch of the key each notification
//! names (by the key's digest), so a waiter learns of an owner in another process finishing
//! as soon as this process does of one of its own; the pollers then only back that up, slowly.

use std::{
    collections::{hash_map, HashMap},
    future::Future,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex, OnceLock, PoisonError, Weak,
    },
    time::Duration,
};

use tokio::{
    sync::{watch, Notify},
    task::JoinHandle,
};

use crate::{
    record::{Record, StoreKey},
    store::{Completion, Completions, StoreError},
};

/// One look at the store, as the waiters of a key see it.
#[derive(Clone, Debug)]
pub(crate) enum Seen {
    /// The live record under the key.
    Record(Record),
    /// No live record: released, or its lease ran out.
    Absent,
    /// No committed record, but a transaction holds the key right now (the transactional
    /// mode: its record becomes visible when it commits).
    #[cfg(feature = "sqlx")]
    Busy,
    /// The lookup failed.
    Failed(Arc<StoreError>),
}

/// What the waiters of one key share.
pub(crate) struct KeyWatch {
    seen: watch::Sender<Option<Seen>>,
    /// Pokes the poller to look now (an owner in this process settled the key).
    look_now: Notify,
}

impl KeyWatch {
    pub(crate) fn publish(&self, seen: Seen) {
        self.seen.send_replace(Some(seen));
    }

    /// Resolves when someone asks for a fresh look; a request made while nobody listened is
    /// kept for the next call.
    async fn look_requested(&self) {
        self.look_now.notified().await
    }

    /// The poller's loop: `look`, publish what it saw, then look again after a pause that
    /// starts at `poll.0` and doubles up to `poll.1`, or at once when asked (an owner in this
    /// process settled the key). Never returns: the last waiter leaving aborts it.
    pub(crate) async fn poll<F, Fut>(&self, poll: (Duration, Duration), mut look: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Seen>,
    {
        let (first, max_pause) = poll;
        let mut pause = first;
        loop {
            self.publish(look().await);
            tokio::select! {
                () = self.look_requested() => pause = first,
                () = tokio::time::sleep(pause) => pause = (pause * 2).min(max_pause),
            }
        }
    }
}

struct Entry {
    subscribers: usize,
    watch: Arc<KeyWatch>,
    poller: JoinHandle<()>,
    /// The key's digest, under which notifications name it (only while a feed is followed).
    digest: Option<[u8; 32]>,
}

#[derive(Default)]
struct Map {
    by_key: HashMap<StoreKey, Entry>,
    /// The keys that have waiters, by digest, for the notifications of the store's feed.
    by_digest: HashMap<[u8; 32], StoreKey>,
}

#[derive(Default)]
pub(crate) struct Waiters {
    map: Mutex<Map>,
    /// The number of keys in `map`, readable without its lock: every owner settling a key
    /// asks for its waiters, and nearly always there are none. Raised before a key's poller
    /// starts, so an owner that reads zero settled before that poller's first look.
    key_count: AtomicUsize,
    /// The task following the store's completion feed, if the store has one; `None` inside
    /// when it has not (decided once, by the first caller of `follow`).
    feed: OnceLock<Option<Follower>>,
}

/// The feed-following task; stopped with the waiters.
struct Follower(JoinHandle<()>);

impl Drop for Follower {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One waiter's interest in a key; dropping it forgets the key once nobody else waits on it.
pub(crate) struct Subscription<'a> {
    waiters: &'a Waiters,
    key: StoreKey,
    seen: watch::Receiver<Option<Seen>>,
}

impl Waiters {
    /// Joins the waiters of `key`, starting its poller with `start` if this is the first, or
    /// `None` when `max` waiters already wait on it.
    pub(crate) fn subscribe(
        &self,
        key: &StoreKey,
        max: usize,
        start: impl FnOnce(Arc<KeyWatch>) -> JoinHandle<()>,
    ) -> Option<Subscription<'_>> {
        let notified = self.notified();
        let mut guard = self.lock();
        let map = &mut *guard;
        let entry = match map.by_key.entry(key.clone()) {
            hash_map::Entry::Occupied(entry) => entry.into_mut(),
            hash_map::Entry::Vacant(vacant) => {
                self.key_count.fetch_add(1, Ordering::SeqCst);
                let watch = Arc::new(KeyWatch {
                    seen: watch::Sender::new(None),
                    look_now: Notify::new(),
                });
                let digest = notified.then(|| key.digest());
                if let Some(digest) = digest {
                    map.by_digest.insert(digest, key.clone());
                }
                let poller = start(watch.clone());
                vacant.insert(Entry {
                    subscribers: 0,
                    watch,
                    poller,
                    digest,
                })
            }
        };
        if entry.subscribers >= max {
            return None;
        }
        entry.subscribers += 1;
        Some(Subscription {
            waiters: self,
            key: key.clone(),
            seen: entry.watch.seen.subscribe(),
        })
    }

    /// Asks the poller of `key`, if any, to look now (called after the owner completed or
    /// released it).
    pub(crate) fn wake(&self, key: &StoreKey) {
        // The owner's store write came first: a poller started after this reads it.
        if self.key_count.load(Ordering::SeqCst) == 0 {
            return;
        }
        if let Some(entry) = self.lock().by_key.get(key) {
            entry.watch.look_now.notify_one();
        }
    }

    /// Follows the store's completion feed from now on, if `completions` gives one (called
    /// once; later calls do nothing). Must run inside a Tokio runtime.
    pub(crate) fn follow(self: &Arc<Self>, completions: impl FnOnce() -> Option<Completions>) {
        self.feed.get_or_init(|| {
            let feed = completions()?;
            Some(Follower(tokio::spawn(follow(Arc::downgrade(self), feed))))
        });
    }

    /// Whether completions are followed: the pollers then only back the notifications up.
    pub(crate) fn notified(&self) -> bool {
        matches!(self.feed.get(), Some(Some(_)))
    }

    fn wake_digest(&self, digest: &[u8; 32]) {
        let map = self.lock();
        if let Some(entry) = map
            .by_digest
            .get(digest)
            .and_then(|key| map.by_key.get(key))
        {
            entry.watch.look_now.notify_one();
        }
    }

    fn wake_all(&self) {
        for entry in self.lock().by_key.values() {
            entry.watch.look_now.notify_one();
        }
    }

    /// How many keys have waiters right now.
    pub(crate) fn keys(&self) -> usize {
        self.key_count.load(Ordering::SeqCst)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Map> {
        // Every change under the lock is a single insert, increment, decrement or removal
        // (of a key and its digest together): a panicking holder cannot leave it half-done.
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Pokes the watch of every key the feed names, until the waiters or the store are gone.
async fn follow(waiters: Weak<Waiters>, mut feed: Completions) {
    while let Some(completion) = feed.next().await {
        let Some(waiters) = waiters.upgrade() else {
            return;
        };
        match completion {
            Completion::Key(digest) => waiters.wake_digest(&digest),
            Completion::Missed => waiters.wake_all(),
        }
    }
}

impl Subscription<'_> {
    /// The next look at the store published after the last one this waiter saw, or `None` if
    /// the poller stopped.
    pub(crate) async fn next(&mut self) -> Option<Seen> {
        self.seen.changed().await.ok()?;
        self.seen.borrow_and_update().clone()
    }
}

impl Drop for Subscription<'_> {
    fn drop(&mut self) {
        let mut guard = self.waiters.lock();
        let map = &mut *guard;
        if let hash_map::Entry::Occupied(mut entry) = map.by_key.entry(self.key.clone()) {
            entry.get_mut().subscribers -= 1;
            if entry.get().subscribers == 0 {
                let entry = entry.remove();
                self.waiters.key_count.fetch_sub(1, Ordering::SeqCst);
                entry.poller.abort();
                if let Some(digest) = entry.digest {
                    map.by_digest.remove(&digest);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle() -> JoinHandle<()> {
        tokio::spawn(std::future::pending())
    }

    #[tokio::test]
    async fn every_subscriber_gets_what_the_poller_publishes() {
        let waiters = Waiters::default();
        let key = StoreKey::new("s", "k");
        let mut shared = None;
        let mut a = waiters
            .subscribe(&key, 8, |watch| {
                shared = Some(watch);
                idle()
            })
            .unwrap();
        let mut b = waiters
            .subscribe(&key, 8, |_| panic!("one poller per key"))
            .unwrap();
        shared.unwrap().publish(Seen::Absent);
        assert!(matches!(a.next().await, Some(Seen::Absent)));
        assert!(matches!(b.next().await, Some(Seen::Absent)));
    }

    #[tokio::test]
    async fn the_map_forgets_keys_nobody_waits_on_and_caps_waiters() {
        let waiters = Waiters::default();
        let key = StoreKey::new("s", "k");
        let a = waiters.subscribe(&key, 2, |_| idle()).unwrap();
        let b = waiters.subscribe(&key, 2, |_| idle()).unwrap();
        assert!(
            waiters.subscribe(&key, 2, |_| idle()).is_none(),
            "over the cap"
        );
        drop(a);
        assert_eq!(waiters.keys(), 1, "b still waits");
        drop(b);
        assert_eq!(waiters.keys(), 0);
    }

    /// `wake` skips the map's lock while no key has waiters: that shortcut must still let
    /// through every wake for a key that has them.
    #[tokio::test]
    async fn a_settled_key_with_waiters_is_looked_at_again_at_once() {
        let waiters = Waiters::default();
        let key = StoreKey::new("s", "k");
        waiters.wake(&key);
        let mut watch = None;
        let waiter = waiters
            .subscribe(&key, 8, |w| {
                watch = Some(w);
                idle()
            })
            .unwrap();
        let watch = watch.unwrap();
        waiters.wake(&StoreKey::new("s", "other"));
        waiters.wake(&key);
        tokio::time::timeout(Duration::from_secs(5), watch.look_requested())
            .await
            .expect("the wake reached the key's poller");
        drop(waiter);
        waiters.wake(&key);
        assert_eq!(waiters.keys(), 0);
    }
}
