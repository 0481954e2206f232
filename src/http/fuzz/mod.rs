//! Property-based fuzzing (proptest) of what this module parses from outside: the
//! `Idempotency-Key` header, stored records read back from a store, and the request
//! fingerprint. Each target runs a few thousand generated cases under `cargo test`; the
//! hostile inputs in `tests/fuzz/corpus/` are replayed by plain tests in [`corpus`].
//!
//! Failures proptest finds are kept in `proptest-regressions/` (committed) and replayed first
//! on every run.

mod corpus;
mod fingerprint;
mod key;
mod record;

use proptest::test_runner::Config;

/// Cases per property: enough to reach the branches of these small parsers, few enough that
/// all the targets together stay within seconds.
fn config() -> Config {
    Config {
        cases: 3000,
        ..Config::default()
    }
}
