//! Shuttle schedules of the waiters' registry (`scripts/shuttle`): waiters joining and leaving
//! a key while owners wake it. The registry's lock and key count are shuttle's here; the
//! tokio watch and `Notify` of the real value are not (shuttle cannot schedule them), so each
//! key's value is a [`Probe`] that counts the wakes reaching it. A wake reaching the value is
//! enough: the real value's `Notify::notify_one` keeps a permit for a poller not yet waiting.

use std::sync::Arc;

use shuttle::{
    sync::atomic::{AtomicBool, AtomicUsize, Ordering},
    thread,
};

use super::registry::Registry;
use crate::{record::StoreKey, sync::explore};

/// A key's value: which one it is, what its poller saw first, and the wakes that reached it.
#[derive(Default)]
struct Probe {
    id: usize,
    first_look_saw_settled: AtomicBool,
    wakes: AtomicUsize,
}

impl Probe {
    fn wake(probe: &Arc<Self>) {
        probe.wakes.fetch_add(1, Ordering::SeqCst);
    }
}

type Probes = Registry<Arc<Probe>>;

fn key(name: &str) -> StoreKey {
    StoreKey::new("shuttle", name)
}

/// Three tasks join two keys (at most two waiters each, so one is turned away) and leave
/// again, while a fourth wakes them: afterwards no key is counted or filed (by key or by
/// digest), and every value started was handed back exactly once, to the last one out.
#[test]
fn shuttle_tests_waiters_leave_nothing_behind() {
    explore(|| {
        let registry = Arc::new(Probes::default());
        let started = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..3)
            .map(|_| {
                let (registry, started) = (registry.clone(), started.clone());
                thread::spawn(move || {
                    let keys = [key("a"), key("b")];
                    let joined: Vec<_> = keys
                        .iter()
                        .filter(|key| {
                            let start = || {
                                let id = started.fetch_add(1, Ordering::SeqCst);
                                Arc::new(Probe {
                                    id,
                                    ..Probe::default()
                                })
                            };
                            registry.join(key, 2, true, start, |_| ()).is_some()
                        })
                        .collect();
                    let handed_back: Vec<usize> = joined
                        .into_iter()
                        .filter_map(|key| registry.leave(key))
                        .map(|probe| probe.id)
                        .collect();
                    handed_back
                })
            })
            .collect();
        let waker = thread::spawn({
            let registry = registry.clone();
            move || {
                registry.wake(&key("a"), Probe::wake);
                registry.wake_digest(&key("b").digest(), Probe::wake);
            }
        });
        let mut handed_back: Vec<usize> = tasks
            .into_iter()
            .flat_map(|task| task.join().unwrap())
            .collect();
        waker.join().unwrap();
        handed_back.sort_unstable();
        let started: Vec<usize> = (0..started.load(Ordering::SeqCst)).collect();
        assert_eq!(handed_back, started, "values started vs handed back");
        assert_eq!(registry.keys(), 0, "keys still counted");
        assert_eq!(registry.filed(), (0, 0), "keys still filed");
    });
}

/// How many times each task of the test below joins and leaves the key.
const ROUNDS: usize = 2;

/// Two tasks each join one key and leave it, twice, while an owner wakes the key: a wake that
/// began after a task's join returned and ended before it started leaving reached the value
/// that task holds (not one its leaving neighbour took away, nor none).
#[test]
fn shuttle_tests_a_wake_reaches_every_waiter_joined_before_it() {
    explore(|| {
        let registry = Arc::new(Probes::default());
        // One flag per task and round: its join returned, and it started leaving.
        let joined: Arc<[AtomicBool; 2 * ROUNDS]> = Arc::default();
        let leaving: Arc<[AtomicBool; 2 * ROUNDS]> = Arc::default();
        let waiters: Vec<_> = (0..2)
            .map(|task| {
                let (registry, joined, leaving) =
                    (registry.clone(), joined.clone(), leaving.clone());
                thread::spawn(move || {
                    let mut probes = Vec::new();
                    for round in task * ROUNDS..(task + 1) * ROUNDS {
                        let probe = registry
                            .join(&key("k"), 8, false, Arc::default, Arc::clone)
                            .unwrap();
                        joined[round].store(true, Ordering::SeqCst);
                        leaving[round].store(true, Ordering::SeqCst);
                        registry.leave(&key("k"));
                        probes.push(probe);
                    }
                    probes
                })
            })
            .collect();
        let owner = thread::spawn({
            let (registry, joined, leaving) = (registry.clone(), joined.clone(), leaving.clone());
            move || {
                let before: Vec<bool> = joined.iter().map(|j| j.load(Ordering::SeqCst)).collect();
                registry.wake(&key("k"), Probe::wake);
                let after: Vec<bool> = leaving.iter().map(|l| l.load(Ordering::SeqCst)).collect();
                let held_throughout = before.into_iter().zip(after).map(|(j, l)| j && !l);
                held_throughout.collect::<Vec<bool>>()
            }
        });
        let probes: Vec<_> = waiters
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect();
        let must_be_woken = owner.join().unwrap();
        for (probe, must) in probes.iter().zip(must_be_woken) {
            if must {
                assert!(
                    probe.wakes.load(Ordering::SeqCst) >= 1,
                    "a joined waiter missed a wake"
                );
            }
        }
        assert_eq!(registry.keys(), 0);
    });
}

/// An owner settles the key (its store write) and wakes it while the first waiter joins and
/// its poller takes a first look from inside `start`, as a spawned poller may on another
/// worker: either that first look saw the write or the wake reached the poller, even though
/// `wake` skips the lock while it reads no keys.
#[test]
fn shuttle_tests_no_wake_is_lost_to_the_unlocked_shortcut() {
    explore(|| {
        let registry = Arc::new(Probes::default());
        let settled = Arc::new(AtomicBool::new(false));
        let waiter = thread::spawn({
            let (registry, settled) = (registry.clone(), settled.clone());
            move || {
                let start = || {
                    let probe = Arc::new(Probe::default());
                    let saw = settled.load(Ordering::SeqCst);
                    probe.first_look_saw_settled.store(saw, Ordering::SeqCst);
                    probe
                };
                registry
                    .join(&key("k"), 8, false, start, Arc::clone)
                    .unwrap()
            }
        });
        let owner = thread::spawn({
            let (registry, settled) = (registry.clone(), settled.clone());
            move || {
                settled.store(true, Ordering::SeqCst);
                registry.wake(&key("k"), Probe::wake);
            }
        });
        let probe = waiter.join().unwrap();
        owner.join().unwrap();
        assert!(
            probe.first_look_saw_settled.load(Ordering::SeqCst)
                || probe.wakes.load(Ordering::SeqCst) >= 1,
            "the poller neither saw the settled key nor was woken"
        );
        registry.leave(&key("k"));
        assert_eq!(registry.keys(), 0);
    });
}
