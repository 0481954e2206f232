//! Shuttle schedules of the lost-lease flag (`scripts/shuttle`): the renewal task renewing or
//! giving the claim up, the claim settling, and handlers reading `is_lost`, all at once. The
//! flag's atomic and lock are shuttle's here; the `Notify` waking `ClaimStatus::lost` is not
//! (shuttle cannot schedule it), so only the state is explored. Time is passed in: each
//! reader reads at a chosen instant, so the schedules alone decide the outcome.

use std::{sync::Arc, time::Duration};

use shuttle::{
    sync::atomic::{AtomicBool, Ordering},
    thread,
};
use tokio::time::Instant;

use super::lease::Lease;
use crate::sync::explore;

/// A handler paused past its lease reads "lost" while the renewal task, late, renews it, and
/// another gives it up: every reader's reads never turn from lost back to held, a reader that
/// starts after `set` returned reads lost, and the claim stays lost at the end.
#[test]
fn shuttle_tests_lost_is_monotonic_and_seen_by_every_reader() {
    explore(|| {
        let start = Instant::now();
        let lease = Arc::new(Lease::new(start + Duration::from_secs(1)));
        let given_up = Arc::new(AtomicBool::new(false));
        // The handler resumes 2 s in, past the lease; the renewal would hold it to 10 s.
        let now = start + Duration::from_secs(2);
        let renewal = thread::spawn({
            let lease = lease.clone();
            move || lease.renewed(start + Duration::from_secs(10))
        });
        let giver = thread::spawn({
            let (lease, given_up) = (lease.clone(), given_up.clone());
            move || {
                lease.set();
                given_up.store(true, Ordering::SeqCst);
            }
        });
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (lease, given_up) = (lease.clone(), given_up.clone());
                thread::spawn(move || {
                    let mut seen_lost = false;
                    for _ in 0..2 {
                        let after_set = given_up.load(Ordering::SeqCst);
                        let lost = lease.is_lost_at(now);
                        assert!(!seen_lost || lost, "a lost claim read as held again");
                        assert!(!after_set || lost, "a read after `set` saw the claim held");
                        seen_lost = lost;
                    }
                })
            })
            .collect();
        for task in [renewal, giver].into_iter().chain(readers) {
            task.join().unwrap();
        }
        assert!(lease.is_lost_at(now), "the claim was given up");
    });
}

/// The renewal task renews a lease (one that then runs out) while the claim settles: once
/// both are done the lease no longer matters, whichever came first, so the claim never reads
/// lost (a renewal after the settle must not bring the lease back).
#[test]
fn shuttle_tests_a_settled_claim_is_never_lost() {
    explore(|| {
        let start = Instant::now();
        let lease = Arc::new(Lease::new(start + Duration::from_secs(1)));
        let renewal = thread::spawn({
            let lease = lease.clone();
            move || {
                lease.renewed(start + Duration::from_secs(2));
                lease.renewed(start + Duration::from_secs(3));
            }
        });
        let claim = thread::spawn({
            let lease = lease.clone();
            move || lease.settled()
        });
        renewal.join().unwrap();
        claim.join().unwrap();
        assert_eq!(lease.until(), None, "a settled claim has a lease again");
        assert!(!lease.is_lost_at(start + Duration::from_secs(3600)));
    });
}
