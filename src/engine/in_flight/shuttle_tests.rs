//! Shuttle schedules of the in-flight count (`scripts/shuttle`): claims entering and leaving
//! on several tasks at once. The wake-up of [`InFlight::idle`] goes through tokio's `Notify`,
//! which shuttle cannot schedule; only the count is explored here.

use std::sync::Arc;

use shuttle::thread;

use super::InFlight;
use crate::sync::explore;

/// Three tasks each hold two claims in turn, overlapping the others': the count never goes
/// past the claims held at once and is back to 0 when all are done, in every schedule.
#[test]
fn shuttle_tests_in_flight_returns_to_zero() {
    let test = || {
        let in_flight = Arc::new(InFlight::default());
        let tasks: Vec<_> = (0..3)
            .map(|_| {
                let in_flight = in_flight.clone();
                thread::spawn(move || {
                    for _ in 0..2 {
                        let guard = in_flight.enter();
                        let held = in_flight.count();
                        assert!((1..=3).contains(&held), "{held} claims counted");
                        drop(guard);
                    }
                })
            })
            .collect();
        for task in tasks {
            task.join().unwrap();
        }
        assert_eq!(in_flight.count(), 0);
    };
    explore(test);
}
