//! Crash tests of the payments example as real processes: SIGKILL of the process that owns a
//! key at each point of its request, then the same request to a fresh process, with the
//! charges counted in the database.
//!
//! - Transactional mode (PostgreSQL, MariaDB, SQLite): killed before the charge, after the
//!   charge but before the commit, or after the commit — always exactly one charge in the end
//!   and an answer that replays.
//! - Separate mode: killed after the charge committed and before the completion — the retry
//!   charges AGAIN once the lease has ended. This is the limit the README documents for that
//!   mode; the test keeps it visible.
#![cfg(all(feature = "postgres", feature = "mysql", feature = "sqlite"))]

#[macro_use]
mod process;

use std::time::Duration;

use http::StatusCode;
use process::{shared::Shared, unique, Charge, Launch};

/// Where in its request the owner dies.
#[derive(Debug, Clone, Copy)]
enum Moment {
    /// In the handler, before it wrote the charge.
    BeforeCharge,
    /// The charge is written, its transaction not yet committed.
    AfterChargeBeforeCommit,
    /// The answer (and so the commit) went out.
    AfterCommit,
}

/// Long enough never to end during a test: the process is killed inside it.
const FOREVER_MS: u64 = 600_000;
const PATIENCE: Duration = Duration::from_secs(20);

async fn transactional_owner_killed(shared: Shared, moment: Moment) {
    let backend = shared.name();
    let launch = Launch::new()
        .envs(&shared.env())
        .env("IDEMPOTENCY_MODE", "transactional");
    let owner = match moment {
        Moment::BeforeCharge => launch.clone().env("PAYMENTS_HANDLER_DELAY_MS", FOREVER_MS),
        Moment::AfterChargeBeforeCommit => launch
            .clone()
            .env("PAYMENTS_DELAY_AFTER_CHARGE_MS", FOREVER_MS),
        Moment::AfterCommit => launch.clone(),
    }
    .start()
    .await;
    owner.wait_for_log("mode: transactional").await;
    let charge = Charge::new(&unique(), &unique());

    let first = match moment {
        Moment::AfterCommit => {
            let reply = owner.charge(&charge).await;
            assert_eq!(reply.status, StatusCode::CREATED, "{backend}");
            Some(reply)
        }
        Moment::BeforeCharge | Moment::AfterChargeBeforeCommit => {
            let http = owner.http();
            let request = charge.clone();
            tokio::spawn(async move { http.try_charge(&request).await });
            let marker = match moment {
                Moment::BeforeCharge => "charging after PAYMENTS_HANDLER_DELAY_MS",
                _ => "charge written; answering after",
            };
            owner.wait_for_log_within(marker, PATIENCE).await;
            None
        }
    };
    owner.kill_9().await;
    let committed = i64::from(first.is_some());
    assert_eq!(
        shared.charge_rows().await,
        committed,
        "{backend}, killed {moment:?}: committed charges"
    );

    let survivor = launch.start().await;
    let retry = survivor.charge(&charge).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "{backend}, killed {moment:?}: {:?}",
        retry.body
    );
    if let Some(first) = &first {
        assert_eq!(
            retry.identity(),
            first.identity(),
            "{backend}: the committed answer replays"
        );
    }
    assert_eq!(
        survivor.charge(&charge).await.identity(),
        retry.identity(),
        "{backend}, killed {moment:?}: the retry's answer replays"
    );
    assert_eq!(
        shared.charge_rows().await,
        1,
        "{backend}, killed {moment:?}: exactly one charge"
    );
}

/// The separate mode's documented limit: the charge committed, the process died before the
/// completion, the lease ran out, and the retry charged a second time.
async fn separate_owner_killed_after_the_charge_charges_twice(shared: Shared) {
    let backend = shared.name();
    let launch = Launch::new()
        .envs(&shared.env())
        .env("IDEMPOTENCY_MODE", "separate")
        .env("IDEMPOTENCY_LEASE_MS", 1_000);
    let owner = launch
        .clone()
        .env("PAYMENTS_DELAY_AFTER_CHARGE_MS", FOREVER_MS)
        .start()
        .await;
    owner.wait_for_log("mode: separate").await;
    let charge = Charge::new(&unique(), &unique());
    let http = owner.http();
    let request = charge.clone();
    tokio::spawn(async move { http.try_charge(&request).await });
    owner
        .wait_for_log_within("charge written; answering after", PATIENCE)
        .await;
    owner.kill_9().await;
    assert_eq!(
        shared.charge_rows().await,
        1,
        "{backend}: the charge committed on its own"
    );

    let survivor = launch.start().await;
    // Waits for the dead owner's lease to end, then runs the handler again.
    let retry = survivor.charge(&charge).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "{backend}: {:?}",
        retry.body
    );
    assert_eq!(
        shared.charge_rows().await,
        2,
        "{backend}: the separate mode charged twice after a crash between the charge and its record"
    );
}

crash_tests! {
    postgres_killed_before_the_charge: Shared::postgres().await =>
        |s| transactional_owner_killed(s, Moment::BeforeCharge);
    postgres_killed_after_the_charge_before_the_commit: Shared::postgres().await =>
        |s| transactional_owner_killed(s, Moment::AfterChargeBeforeCommit);
    postgres_killed_after_the_commit: Shared::postgres().await =>
        |s| transactional_owner_killed(s, Moment::AfterCommit);
    mysql_killed_before_the_charge: Shared::mysql().await =>
        |s| transactional_owner_killed(s, Moment::BeforeCharge);
    mysql_killed_after_the_charge_before_the_commit: Shared::mysql().await =>
        |s| transactional_owner_killed(s, Moment::AfterChargeBeforeCommit);
    mysql_killed_after_the_commit: Shared::mysql().await =>
        |s| transactional_owner_killed(s, Moment::AfterCommit);
    sqlite_killed_before_the_charge: Some(Shared::sqlite()) =>
        |s| transactional_owner_killed(s, Moment::BeforeCharge);
    sqlite_killed_after_the_charge_before_the_commit: Some(Shared::sqlite()) =>
        |s| transactional_owner_killed(s, Moment::AfterChargeBeforeCommit);
    sqlite_killed_after_the_commit: Some(Shared::sqlite()) =>
        |s| transactional_owner_killed(s, Moment::AfterCommit);
    postgres_separate_mode_charges_twice_after_a_crash: Shared::postgres().await =>
        separate_owner_killed_after_the_charge_charges_twice;
    mysql_separate_mode_charges_twice_after_a_crash: Shared::mysql().await =>
        separate_owner_killed_after_the_charge_charges_twice;
    sqlite_separate_mode_charges_twice_after_a_crash: Some(Shared::sqlite()) =>
        separate_owner_killed_after_the_charge_charges_twice;
}
