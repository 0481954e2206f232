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

mod registry;

use std::{
    future::Future,
    sync::{Arc, OnceLock, Weak},
    time::Duration,
};

use tokio::{
    sync::{watch, Notify},
    task::JoinHandle,
};

use self::registry::Registry;
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

/// A key's value in the registry: the watch its waiters share and the poller feeding it.
struct Watched {
    watch: Arc<KeyWatch>,
    poller: JoinHandle<()>,
}

#[derive(Default)]
pub(crate) struct Waiters {
    keys: Registry<Watched>,
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
        self.keys
            .join(
                key,
                max,
                self.notified(),
                || {
                    let watch = Arc::new(KeyWatch {
                        seen: watch::Sender::new(None),
                        look_now: Notify::new(),
                    });
                    let poller = start(watch.clone());
                    Watched { watch, poller }
                },
                |watched| watched.watch.seen.subscribe(),
            )
            .map(|seen| Subscription {
                waiters: self,
                key: key.clone(),
                seen,
            })
    }

    /// Asks the poller of `key`, if any, to look now (called after the owner completed or
    /// released it).
    pub(crate) fn wake(&self, key: &StoreKey) {
        self.keys.wake(key, Watched::look_now);
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
        self.keys.wake_digest(digest, Watched::look_now);
    }

    fn wake_all(&self) {
        self.keys.wake_all(Watched::look_now);
    }

    /// How many keys have waiters right now.
    pub(crate) fn keys(&self) -> usize {
        self.keys.keys()
    }
}

impl Watched {
    fn look_now(&self) {
        self.watch.look_now.notify_one();
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
        if let Some(watched) = self.waiters.keys.leave(&self.key) {
            watched.poller.abort();
        }
    }
}

#[cfg(all(test, shuttle))]
mod shuttle_tests;

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
