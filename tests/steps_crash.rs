//! Recovery points under SIGKILL: the payments example with `PROCESSOR_URL` charges through
//! the `processor` example (a second process, itself behind this library, counting its
//! charges) in three steps. Its owner is killed at every step boundary and the same request
//! retried on a fresh process: exactly one processor charge, one local payment, `paid`, and
//! the same answer for every retry. The same kill without steps shows the separate mode's
//! documented double, so the test can fail. On PostgreSQL, MariaDB and SQLite.
#![cfg(all(feature = "postgres", feature = "mysql", feature = "sqlite"))]

#[macro_use]
mod process;

use std::time::Duration;

use http::StatusCode;
use process::{shared::Shared, unique, Charge, Launch, Server};

const PATIENCE: Duration = Duration::from_secs(20);

/// The processor: in memory, never killed.
async fn processor() -> Server {
    let processor = Launch::new().program("processor").start().await;
    processor.wait_for_log("processor listening").await;
    processor
}

/// Starts an owner that stops at `point`, sends it `charge`, kills it there with SIGKILL.
async fn kill_owner_at(launch: &Launch, point: &str, charge: &Charge) {
    let owner = launch.clone().env("PAYMENTS_PAUSE_AT", point).start().await;
    let http = owner.http();
    let request = charge.clone();
    tokio::spawn(async move { http.try_charge(&request).await });
    owner
        .wait_for_log_within(&format!("steps: paused at {point}"), PATIENCE)
        .await;
    owner.kill_9().await;
}

/// The payments processes: separate mode, a 1 s lease (a dead owner's key frees up quickly).
fn payments(shared: &Shared, processor: &Server) -> Launch {
    Launch::new()
        .envs(&shared.env())
        .env("IDEMPOTENCY_MODE", "separate")
        .env("IDEMPOTENCY_LEASE_MS", 1_000)
        .env("PROCESSOR_URL", format!("http://{}", processor.addr))
}

/// Killed at `point`, retried on a fresh process: one charge, one payment, one answer.
async fn owner_killed(shared: Shared, point: &'static str) {
    let backend = shared.name();
    let processor = processor().await;
    let launch = payments(&shared, &processor);
    let charge = Charge::new(&unique(), &unique());
    kill_owner_at(&launch, point, &charge).await;

    let survivor = launch.start().await;
    let retry = survivor.charge(&charge).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "{backend}, killed {point}: {:?}",
        retry.body
    );
    let answer = retry.json();
    assert_eq!(answer["status"], "paid", "{backend}, killed {point}");
    assert!(answer["charge_id"]
        .as_str()
        .is_some_and(|id| id.starts_with("ch_")));
    let again = survivor.charge(&charge).await;
    assert_eq!(
        again.identity(),
        retry.identity(),
        "{backend}, killed {point}: replayed"
    );
    let id = answer["id"].as_str().expect("an id");
    assert_eq!(
        survivor.get(&format!("/payments/{id}")).await.json()["status"],
        "paid"
    );

    assert_eq!(
        processor.charges().await,
        1,
        "{backend}, killed {point}: processor charges"
    );
    assert_eq!(
        shared.rows("payments").await,
        1,
        "{backend}, killed {point}: payments"
    );
    assert_eq!(
        shared.rows("payment_charges").await,
        1,
        "{backend}, killed {point}: charge ids"
    );
}

/// Without steps (a fresh key downstream per attempt, as a plain separate-mode handler does)
/// the same kill after the processor's charge charges twice.
async fn without_steps_charges_twice(shared: Shared) {
    let backend = shared.name();
    let processor = processor().await;
    let launch = payments(&shared, &processor).env("PAYMENTS_STEPS", "off");
    let charge = Charge::new(&unique(), &unique());
    kill_owner_at(&launch, "after-charge", &charge).await;

    let survivor = launch.start().await;
    let retry = survivor.charge(&charge).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "{backend}: {:?}",
        retry.body
    );
    assert_eq!(
        processor.charges().await,
        2,
        "{backend}: without steps the retry charged the card again"
    );
}

// mutant: journaled steps are ignored (`Steps::journaled` always `None`) ->
// postgres_killed_after_its_journal_entry (and mysql_killed_after_its_journal_entry) fails
// with "payments" 2 (the retry recorded a second payment). mutant: the derived key takes a random field (not stable across attempts) ->
// postgres_killed_after_the_charge fails with "processor charges" 2. The `without_steps`
// tests are the unprotected baseline: the same kill charges twice.
crash_tests! {
    postgres_killed_before_the_charge: Shared::postgres().await =>
        |s| owner_killed(s, "before-charge");
    postgres_killed_after_the_charge: Shared::postgres().await =>
        |s| owner_killed(s, "after-charge");
    postgres_killed_after_its_journal_entry: Shared::postgres().await =>
        |s| owner_killed(s, "after-journal");
    postgres_killed_after_the_local_phase: Shared::postgres().await =>
        |s| owner_killed(s, "after-local");
    postgres_without_steps_charges_twice: Shared::postgres().await =>
        without_steps_charges_twice;
    mysql_killed_before_the_charge: Shared::mysql().await =>
        |s| owner_killed(s, "before-charge");
    mysql_killed_after_the_charge: Shared::mysql().await =>
        |s| owner_killed(s, "after-charge");
    mysql_killed_after_its_journal_entry: Shared::mysql().await =>
        |s| owner_killed(s, "after-journal");
    mysql_killed_after_the_local_phase: Shared::mysql().await =>
        |s| owner_killed(s, "after-local");
    mysql_without_steps_charges_twice: Shared::mysql().await =>
        without_steps_charges_twice;
    sqlite_killed_before_the_charge: Some(Shared::sqlite()) =>
        |s| owner_killed(s, "before-charge");
    sqlite_killed_after_the_charge: Some(Shared::sqlite()) =>
        |s| owner_killed(s, "after-charge");
    sqlite_killed_after_its_journal_entry: Some(Shared::sqlite()) =>
        |s| owner_killed(s, "after-journal");
    sqlite_killed_after_the_local_phase: Some(Shared::sqlite()) =>
        |s| owner_killed(s, "after-local");
    sqlite_without_steps_charges_twice: Some(Shared::sqlite()) =>
        without_steps_charges_twice;
}
