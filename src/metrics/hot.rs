//! The handles of the events every request records, registered once with the global
//! recorder instead of looked up in its registry at every event.
//!
//! A recorder's registry lookup (hash the key, find it under a lock) is most of what an event
//! costs: five per new key, about 0.7 µs over HTTP with the Prometheus exporter. `metrics`
//! itself says to register a handle once and keep it; a library cannot simply do that, because
//! the recorder that gets an event is chosen at the event. A handle kept from the first event
//! would send every later event to that first recorder, wherever it came from:
//!
//! - a recorder installed after the first request (the no-op recorder answered until then);
//! - a local recorder (`metrics::with_local_recorder`), which a test sets around its own
//!   requests and drops afterwards; the next test's recorder may then sit at the same address,
//!   so not even the address tells them apart.
//!
//! So handles are kept only for the global recorder, which `metrics` sets at most once per
//! process and never frees: nothing else can ever have its address. Which recorder is the
//! global one is seen from a new thread, where no local recorder can be set; that look is
//! taken once per process, and once per local recorder per thread while no global recorder
//! has been seen (remembered, so a test's events do not each start a thread). Every other
//! recorder gets the facade's lookup at every event, as before.

use std::{cell::Cell, sync::OnceLock};

use ::metrics::{Counter, Gauge, Histogram, Recorder};

use super::keys;

struct Hot {
    /// The address of the global recorder that the handles were registered with.
    recorder: usize,
    outcomes: [Counter; keys::OUTCOMES.len()],
    operations: [Histogram; keys::OPERATIONS.len()],
    claims_in_flight: Gauge,
}

static HOT: OnceLock<Hot> = OnceLock::new();

thread_local! {
    /// The last recorder this thread found not to be the global one (0: none yet).
    static NOT_GLOBAL: Cell<usize> = const { Cell::new(0) };
}

/// Hands `record` the request counter of `keys::OUTCOMES[outcome]`.
pub(super) fn outcome(outcome: usize, record: impl FnOnce(&Counter)) {
    with_handle(
        |hot| &hot.outcomes[outcome],
        |recorder| register_outcome(recorder, outcome),
        record,
    )
}

/// Hands `record` the latency histogram of `keys::OPERATIONS[operation]`.
pub(super) fn operation(operation: usize, record: impl FnOnce(&Histogram)) {
    with_handle(
        |hot| &hot.operations[operation],
        |recorder| register_operation(recorder, operation),
        record,
    )
}

/// Hands `record` the claims-in-flight gauge.
pub(super) fn claims_in_flight(record: impl FnOnce(&Gauge)) {
    with_handle(
        |hot| &hot.claims_in_flight,
        register_claims_in_flight,
        record,
    )
}

/// Hands `record` the current recorder's handle: the kept one (`kept`) for the global
/// recorder, a freshly registered one (`register`) for any other.
fn with_handle<H: 'static>(
    kept: impl FnOnce(&'static Hot) -> &'static H,
    register: impl FnOnce(&dyn Recorder) -> H,
    record: impl FnOnce(&H),
) {
    ::metrics::with_recorder(|recorder| match cached(recorder) {
        Some(hot) => record(kept(hot)),
        None => record(&register(recorder)),
    })
}

fn register_outcome(recorder: &dyn Recorder, outcome: usize) -> Counter {
    recorder.register_counter(&keys::OUTCOMES[outcome].1, &keys::METADATA)
}

fn register_operation(recorder: &dyn Recorder, operation: usize) -> Histogram {
    recorder.register_histogram(&keys::OPERATIONS[operation].1, &keys::METADATA)
}

fn register_claims_in_flight(recorder: &dyn Recorder) -> Gauge {
    recorder.register_gauge(&keys::CLAIMS_IN_FLIGHT, &keys::METADATA)
}

/// The kept handles, if `recorder` is the global recorder.
fn cached(recorder: &dyn Recorder) -> Option<&'static Hot> {
    let address = address(recorder);
    if let Some(hot) = HOT.get() {
        // The global recorder is set: any other address is another recorder.
        return (hot.recorder == address).then_some(hot);
    }
    // Zero-sized recorders (the no-op one among them) may share one dangling address, so an
    // address names none of them.
    if std::mem::size_of_val(recorder) == 0 || NOT_GLOBAL.get() == address {
        return None;
    }
    if global_address() != Some(address) {
        NOT_GLOBAL.set(address);
        return None;
    }
    let hot = HOT.get_or_init(|| Hot {
        recorder: address,
        outcomes: std::array::from_fn(|outcome| register_outcome(recorder, outcome)),
        operations: std::array::from_fn(|operation| register_operation(recorder, operation)),
        claims_in_flight: register_claims_in_flight(recorder),
    });
    Some(hot)
}

/// The address of the recorder a thread without a local recorder gets: the global one (or
/// the no-op one, while none is installed). `None` if no thread could be started.
fn global_address() -> Option<usize> {
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("metrics-recorder-probe".to_owned())
            .spawn_scoped(scope, || ::metrics::with_recorder(address))
            .ok()?
            .join()
            .ok()
    })
}

fn address(recorder: &dyn Recorder) -> usize {
    std::ptr::from_ref(recorder).cast::<()>().addr()
}

#[cfg(test)]
mod tests {
    use metrics_exporter_prometheus::PrometheusBuilder;

    use super::*;

    /// What `tests/metrics_recorders.rs` cannot see from outside: the handles are kept for
    /// the global recorder (the point of this module), and for no other.
    #[test]
    fn the_global_recorder_s_handles_are_kept_and_no_other_s() {
        // The only global recorder of this test binary; its other tests merely record into it.
        let _ = PrometheusBuilder::new().install_recorder();
        let kept = || ::metrics::with_recorder(|recorder| cached(recorder).is_some());
        assert!(kept(), "the global recorder's handles are not kept");
        let local = PrometheusBuilder::new().build_recorder();
        assert!(!::metrics::with_local_recorder(&local, kept));
        assert!(!::metrics::with_local_recorder(
            &::metrics::NoopRecorder,
            kept
        ));
        assert!(kept());
    }
}
