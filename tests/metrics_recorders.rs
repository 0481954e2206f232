//! Which recorder gets the layer's metrics: the one current at each event. The crate keeps
//! the handles of the global recorder; this test checks that keeping them never sends an
//! event to a recorder other than the current one (a local recorder, one installed late, one
//! at the address of a dropped one).
//!
//! One test, in a binary of its own: the global recorder is set once per process. The series
//! are spelled out, as a dashboard spells them.

mod common;

use axum::{http::StatusCode, Router};
use common::{app, post_req, send, Runs};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusRecorder};
use tower_idempotency::{store::MemoryStore, IdempotencyLayer};

const EXECUTED: &str = "idempotency_requests_total{outcome=\"executed\"}";
const REPLAYED: &str = "idempotency_requests_total{outcome=\"replayed\"}";
const CLAIMS: &str = "idempotency_store_operation_seconds_count{operation=\"claim\"}";
const COMPLETES: &str = "idempotency_store_operation_seconds_count{operation=\"complete\"}";
const IN_FLIGHT: &str = "idempotency_claims_in_flight";

#[test]
fn every_event_reaches_the_recorder_current_when_it_happened() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let runs = Runs::default();
    let app = app(IdempotencyLayer::new(MemoryStore::new()), runs.clone());
    let mut next_key = 0;
    let mut requests = |new_keys: usize, replays: usize| {
        let first = next_key;
        next_key += new_keys;
        runtime.block_on(serve(&app, first, new_keys, replays))
    };

    // No recorder at all: the no-op recorder takes the events.
    requests(1, 1);

    // Two local recorders one after the other, at the same address: each gets its own
    // events, not the first one's handles.
    let mut addresses = Vec::new();
    for round in 0..2 {
        let local = PrometheusBuilder::new().build_recorder();
        addresses.push(std::ptr::from_ref(&local).addr());
        ::metrics::with_local_recorder(&local, || requests(1 + round, round));
        let seen = Seen::of(&local);
        assert_eq!(seen.value(EXECUTED), 1 + round, "round {round}");
        assert_eq!(seen.value(REPLAYED), round);
        assert_eq!(seen.value(CLAIMS), 1 + 2 * round);
        assert_eq!(seen.value(COMPLETES), 1 + round);
        assert_eq!(seen.value(IN_FLIGHT), 0);
    }
    assert_eq!(
        addresses[0], addresses[1],
        "the second local recorder must reuse the first one's address for this test to mean anything"
    );

    // A global recorder installed after all that: counts from its installation on.
    let global = PrometheusBuilder::new()
        .install_recorder()
        .expect("this test is the only one in its process");
    requests(3, 1);
    let expected = [(EXECUTED, 3), (REPLAYED, 1), (CLAIMS, 4), (COMPLETES, 3)];
    let seen = Seen(global.render());
    for (series, count) in expected {
        assert_eq!(seen.value(series), count, "{series}");
    }
    assert_eq!(seen.value(IN_FLIGHT), 0);

    // A local recorder while the global recorder's handles are kept: the local one gets the
    // events made under it, and the global one does not.
    let local = PrometheusBuilder::new().build_recorder();
    ::metrics::with_local_recorder(&local, || requests(2, 0));
    assert_eq!(Seen::of(&local).value(EXECUTED), 2);
    let seen = Seen(global.render());
    for (series, count) in expected {
        assert_eq!(seen.value(series), count, "{series}");
    }

    // And the global one again.
    requests(1, 0);
    assert_eq!(Seen(global.render()).value(EXECUTED), 4);
    assert_eq!(runs.count(), 1 + 1 + 2 + 3 + 2 + 1);
}

/// Sends `new_keys` requests with keys from `first` on, then `replays` duplicates of the
/// first of them.
async fn serve(app: &Router, first: usize, new_keys: usize, replays: usize) {
    for key in first..first + new_keys {
        let answer = send(app, post_req("/pay", Some(&format!("k{key}")), "{}")).await;
        assert_eq!(answer.status, StatusCode::CREATED);
    }
    for _ in 0..replays {
        let answer = send(app, post_req("/pay", Some(&format!("k{first}")), "{}")).await;
        assert_eq!(answer.status, StatusCode::CREATED);
    }
}

/// A recorder's series, in the Prometheus text format.
struct Seen(String);

impl Seen {
    fn of(recorder: &PrometheusRecorder) -> Self {
        Self(recorder.handle().render())
    }

    /// The value of `series`; 0 if the recorder never had it.
    fn value(&self, series: &str) -> usize {
        let line = self.0.lines().find(|line| {
            line.strip_prefix(series)
                .is_some_and(|rest| rest.starts_with(' '))
        });
        line.map_or(0, |line| {
            let value = line[series.len()..].trim();
            value.parse::<f64>().unwrap_or_else(|_| panic!("{line}")) as usize
        })
    }
}
