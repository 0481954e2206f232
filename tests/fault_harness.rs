//! The fault harness, short (issue 24, part 4): per store and mode, two `payments` processes
//! on one store, every key sent twice at once and retried until final, while a nemesis
//! SIGKILLs and restarts a process, SIGSTOPs one past its lease, and has the server end the
//! processes' store sessions (also inside open transactions, to make commits whose outcome
//! is unknown). The checker counts each key's effects in the database.
//!
//! Fails on any double in the transactional mode, any double in the separate mode that no
//! fault explains (the mode's documented limit: an effect committed, its record not), and
//! any lost, stuck or differing key. Prints one table row per run (`fault-harness-row:`).
//!
//! `FAULT_HARNESS_SECS` sets each run's seconds of new keys (default 10); the runs take
//! turns, as five at once would overload a small machine. `scripts/bench.d/faults.sh` runs
//! them long.
#![cfg(all(
    feature = "postgres",
    feature = "mysql",
    feature = "sqlite",
    feature = "redis"
))]

mod harness;
mod process;

use bytes::Bytes;
use harness::{
    checker::{self, Report},
    effects, History, Plan,
};
use process::shared::Shared;

/// One run at a time (an async lock: the tests' runtimes differ, and it is held across
/// awaits).
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs the harness on `shared`, prints its row and fails on what it found.
async fn harness(shared: &Shared, separate: bool) -> (History, Plan) {
    let _turn = TURN.lock().await;
    let plan = Plan::from_env(separate);
    let history = harness::run(shared, &plan).await;
    let report = history.check(shared, &plan).await;
    print_row(&report, shared, &plan);
    let failures = report.failures();
    assert!(
        failures.is_empty(),
        "{} {}: {failures:?}\n{}",
        shared.name(),
        plan.mode(),
        report.problems.join("\n")
    );
    assert!(report.keys > 0, "no key was sent");
    (history, plan)
}

/// The checker's own mutants, on a real history that passed: one charge row planted behind
/// the example's back must show as a double, one key's rows left out as a lost key, one
/// fresh answer missing as a stuck key, one copy's answer changed as a differing key.
async fn the_checker_catches_what_is_planted(shared: &Shared, history: History, plan: &Plan) {
    let first = history.logs.first().expect("a key").key.amount;
    let mut charges = effects::charges(shared).await;
    charges.retain(|row| row.amount != first);
    let report = checker::check(
        plan.separate,
        &history.logs,
        &history.fresh,
        &charges,
        &history.faults,
    );
    assert_eq!(
        report.lost, 1,
        "the key without its charge row was not seen"
    );
    let mut fresh = history.fresh.clone();
    fresh[0] = None;
    let report = checker::check(
        plan.separate,
        &history.logs,
        &fresh,
        &effects::charges(shared).await,
        &history.faults,
    );
    assert_eq!(
        report.stuck, 1,
        "the key without a fresh answer was not seen"
    );

    effects::plant_charge(shared, first).await;
    let report = history.check(shared, plan).await;
    assert_eq!(report.doubles, 1, "the planted double was not seen");
    assert!(!report.failures().is_empty());

    let mut changed = history;
    let answer = changed.logs[1].copies[1]
        .answer
        .as_mut()
        .expect("a final answer");
    answer.body = Bytes::from_static(b"{\"id\": \"someone else's\"}");
    let report = changed.check(shared, plan).await;
    assert_eq!(
        report.differing, 1,
        "the planted differing answer was not seen"
    );
}

fn print_row(report: &Report, shared: &Shared, plan: &Plan) {
    println!(
        "fault-harness-row: {}",
        report.row(shared.name(), plan.mode(), plan.duration.as_secs())
    );
}

macro_rules! harness_tests {
    ($($name:ident: $open:expr, separate = $separate:expr;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            if let Some(shared) = $open {
                shared.run(|s| async move { harness(&s, $separate).await; }).await;
            }
        }
    )*};
}

/// Also the checker's mutants, on this run's history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_transactional() {
    if let Some(shared) = Shared::postgres().await {
        shared
            .run(|s| async move {
                let (history, plan) = harness(&s, false).await;
                the_checker_catches_what_is_planted(&s, history, &plan).await;
            })
            .await;
    }
}

harness_tests! {
    postgres_separate: Shared::postgres().await, separate = true;
    mysql_transactional: Shared::mysql().await, separate = false;
    sqlite_transactional: Some(Shared::sqlite()), separate = false;
    redis_separate: Shared::redis(), separate = true;
}
