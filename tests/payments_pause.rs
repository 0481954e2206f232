//! The separate mode's owner paused (SIGSTOP) past its lease while its handler waits, a
//! second process takes the key over and charges, then the owner resumes: its handler checks
//! `ClaimStatus::is_lost()` before the charge and steps back (503 `lease-lost`) instead of
//! charging a second time. The charges are counted in the database; the paused owner's
//! client retries and gets the other process's answer.
//!
//! Found by the partition runs (tests/fault_partition.rs): without the check, an owner whose
//! handler outlived its lease charged although a duplicate had already charged elsewhere.
#![cfg(all(feature = "postgres", feature = "sqlite", feature = "redis"))]

mod process;

use std::time::Duration;

use http::StatusCode;
use process::{shared::Shared, unique, Charge, Launch};

const LEASE_MS: u64 = 1_000;
/// The owner's handler waits this long before it charges: it is paused inside the wait.
const HANDLER_DELAY_MS: u64 = 1_500;
/// Longer than the lease, so the store frees the key while the owner is stopped.
const PAUSE: Duration = Duration::from_millis(2_500);
const PATIENCE: Duration = Duration::from_secs(20);

async fn paused_owner_steps_back(shared: Shared) {
    let backend = shared.name();
    let launch = Launch::new()
        .envs(&shared.env())
        .env("IDEMPOTENCY_MODE", "separate")
        .env("IDEMPOTENCY_LEASE_MS", LEASE_MS);
    let owner = launch
        .clone()
        .env("PAYMENTS_HANDLER_DELAY_MS", HANDLER_DELAY_MS)
        .start()
        .await;
    let other = launch.start().await;
    let charge = Charge::new(&unique(), &unique());

    let owner_http = owner.http();
    let request = charge.clone();
    let first = tokio::spawn(async move { owner_http.try_charge(&request).await });
    owner
        .wait_for_log_within("charging after PAYMENTS_HANDLER_DELAY_MS", PATIENCE)
        .await;
    owner.pause();
    tokio::time::sleep(PAUSE).await;

    let taken_over = other.charge(&charge).await;
    assert_eq!(
        taken_over.status,
        StatusCode::CREATED,
        "{backend}: the takeover"
    );
    owner.resume();

    let stepped_back = tokio::time::timeout(PATIENCE, first)
        .await
        .expect("the resumed owner answers")
        .expect("the client task")
        .expect("an answer, not a transport error");
    stepped_back.assert_problem(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        stepped_back.json()["type"],
        "urn:payments:lease-lost",
        "{backend}: the resumed owner's answer"
    );
    assert_eq!(shared.charge_rows().await, 1, "{backend}: charges");

    let retry = owner.charge(&charge).await;
    assert_eq!(
        retry.identity(),
        taken_over.identity(),
        "{backend}: the owner's retry replays the other process's answer"
    );
    assert_eq!(
        shared.charge_rows().await,
        1,
        "{backend}: charges after the retry"
    );
}

#[tokio::test]
async fn redis() {
    let Some(shared) = Shared::redis() else {
        return;
    };
    shared.run(paused_owner_steps_back).await;
}

#[tokio::test]
async fn postgres() {
    let Some(shared) = Shared::postgres().await else {
        return;
    };
    shared.run(paused_owner_steps_back).await;
}
