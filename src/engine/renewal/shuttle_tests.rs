//! Shuttle schedules of the renewal registry (`scripts/shuttle`): claims registering and
//! stopping while the renewer hands the due ones out and decides to end. The registry's lock
//! is shuttle's here; tokio's tasks and `Notify` are not (shuttle cannot schedule them), so
//! the renewer is a shuttle thread making one look, and each task a [`Fake`] that records
//! whether it was aborted. Every claim is due already, so one look hands out all there are.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use shuttle::{
    sync::atomic::{AtomicBool, AtomicUsize, Ordering},
    thread::{self, JoinHandle},
};
use tokio::time::Instant;

use super::registry::{Registry, Task};
use crate::sync::explore;

/// A task as the registry sees it.
#[derive(Clone, Default)]
struct Fake {
    finished: Arc<AtomicBool>,
    aborted: Arc<AtomicBool>,
}

impl Task for Fake {
    fn is_finished(&self) -> bool {
        self.finished.load(Ordering::SeqCst)
    }

    fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
    }
}

/// The registry, the renewers it started (to join at the end) and the renewing tasks they
/// started (to check at the end).
#[derive(Clone)]
struct World {
    registry: Arc<Registry<(), Fake>>,
    renewers: Arc<Mutex<Vec<JoinHandle<()>>>>,
    renewing: Arc<Mutex<Vec<Fake>>>,
    renewers_started: Arc<AtomicUsize>,
    due: Instant,
}

impl World {
    fn new() -> Self {
        Self {
            registry: Arc::default(),
            renewers: Arc::default(),
            renewing: Arc::default(),
            renewers_started: Arc::default(),
            due: Instant::now(),
        }
    }

    /// Registers a claim (due already); a renewer it starts makes one look and ends if that
    /// look left nothing to watch, as the real one does.
    fn register(&self) -> u64 {
        let spawn_renewer = || {
            self.renewers_started.fetch_add(1, Ordering::SeqCst);
            let renewer = Fake::default();
            let world = self.clone();
            let finished = renewer.finished.clone();
            let thread = thread::spawn(move || {
                let now = world.due + Duration::from_secs(1);
                let next = world.registry.hand_out_due(now, |()| {
                    let task = Fake::default();
                    world.renewing.lock().unwrap().push(task.clone());
                    task
                });
                assert_eq!(next, None, "every claim was due");
                finished.store(true, Ordering::SeqCst);
            });
            self.renewers.lock().unwrap().push(thread);
            renewer
        };
        self.registry.register(self.due, (), spawn_renewer).id
    }

    /// Runs `claim` on two tasks at once, then waits for them and for every renewer they
    /// started.
    fn claims(&self, claim: impl Fn(&Self) + Send + Sync + Clone + 'static) {
        let claims: Vec<_> = (0..2)
            .map(|_| {
                let (world, claim) = (self.clone(), claim.clone());
                thread::spawn(move || claim(&world))
            })
            .collect();
        for claim in claims {
            claim.join().unwrap();
        }
        let renewers = std::mem::take(&mut *self.renewers.lock().unwrap());
        for renewer in renewers {
            renewer.join().unwrap();
        }
    }
}

/// Two claims register while the renewer started by the first may be deciding to end: once
/// every renewer is done, no claim still waits for its first renewal (each was handed a
/// renewing task), and no more than one renewer ran per claim.
#[test]
fn shuttle_tests_no_claim_is_left_without_a_renewer() {
    explore(|| {
        let world = World::new();
        world.claims(|world| {
            world.register();
        });
        assert_eq!(world.registry.filed(), (0, 2), "(waiting, renewing)");
        assert!(world.renewers_started.load(Ordering::SeqCst) <= 2);
    });
}

/// Two claims register and stop while the renewer hands them out: afterwards nothing is
/// filed, and every renewing task the renewer started for them was aborted.
#[test]
fn shuttle_tests_a_stopped_claim_leaves_no_renewing_task() {
    explore(|| {
        let world = World::new();
        world.claims(|world| {
            let id = world.register();
            world.registry.stop(world.due, id);
        });
        assert_eq!(world.registry.filed(), (0, 0), "(waiting, renewing)");
        for task in world.renewing.lock().unwrap().iter() {
            assert!(
                task.aborted.load(Ordering::SeqCst),
                "a stopped claim's task runs on"
            );
        }
    });
}

/// The renewer sleeps until its next claim is due, so a claim due sooner must wake it. The
/// renewer looks again (nothing due yet: an earlier claim stopped, the next is due at 10 s)
/// while a claim due at 5 s registers: either that look saw the new claim (it wakes by 5 s)
/// or the registration asked for a wake-up (the renewer's `Notify` was enabled before it
/// looked, so the wake-up reaches it).
#[test]
fn shuttle_tests_a_claim_due_sooner_wakes_the_renewer() {
    explore(|| {
        let start = Instant::now();
        let at = move |secs| start + Duration::from_secs(secs);
        let registry = Arc::new(Registry::<(), Fake>::default());
        // A renewer runs (its task never finishes here) and last slept until 1 s.
        let earlier = registry.register(at(1), (), Fake::default);
        registry.register(at(10), (), || unreachable!("a renewer runs"));
        assert_eq!(
            registry.hand_out_due(start, |()| unreachable!()),
            Some(at(1))
        );
        registry.stop(at(1), earlier.id);
        let renewer = thread::spawn({
            let registry = registry.clone();
            move || registry.hand_out_due(start, |()| unreachable!("nothing is due"))
        });
        let claim = thread::spawn({
            let registry = registry.clone();
            move || registry.register(at(5), (), || unreachable!("a renewer runs"))
        });
        let sleeps_until = renewer.join().unwrap().expect("claims are waiting");
        let registered = claim.join().unwrap();
        assert!(
            sleeps_until <= at(5) || registered.wake_renewer,
            "the renewer sleeps past a claim's due time, unwoken"
        );
    });
}
