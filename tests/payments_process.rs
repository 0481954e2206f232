//! The `payments` example as a black box: real processes, real HTTP, real databases.
//! Every test checks side effects — the charges recorded (`/stats`, rows in the database) —
//! not only statuses.
//!
//! The multi-process tests need servers and skip themselves ("skipped: VAR is not set")
//! unless their URL is set; `TEST_REQUIRE_ALL_BACKENDS=1` turns a skip into a failure:
//!
//! ```text
//! TEST_POSTGRES_URL=postgres://root@127.0.0.1/test TEST_MYSQL_URL=mysql://root@127.0.0.1/test \
//! TEST_REDIS_URL=redis://127.0.0.1:6379 cargo test --test payments_process
//! ```
//!
//! `cargo test` builds the example binary; with `--test payments_process` alone, run
//! `cargo build --example payments` first.

mod process;

use std::{collections::HashSet, sync::Arc, time::Duration};

use http::{header, StatusCode};
use process::{shared::Shared, unique, Charge, Http, Launch, Reply};
use tokio::{sync::Barrier, task::JoinSet};

/// Sends `copies` of `charge` at once (released together by a barrier), spread round-robin
/// over `servers`, and returns the replies.
async fn storm(servers: &[Http], charge: &Charge, copies: usize) -> Vec<Reply> {
    let barrier = Arc::new(Barrier::new(copies));
    let mut tasks = JoinSet::new();
    for copy in 0..copies {
        let (http, charge, barrier) = (
            servers[copy % servers.len()].clone(),
            charge.clone(),
            barrier.clone(),
        );
        tasks.spawn(async move {
            barrier.wait().await;
            http.charge(&charge).await
        });
    }
    tasks.join_all().await
}

/// Asserts that every reply is the same `201`, and returns it.
fn one_created(replies: &[Reply]) -> &Reply {
    let first = &replies[0];
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    for reply in replies {
        assert_eq!(
            reply.identity(),
            first.identity(),
            "a duplicate got another answer"
        );
    }
    first
}

fn payment_id(reply: &Reply) -> String {
    reply.json()["id"]
        .as_str()
        .expect("id is a string")
        .to_owned()
}

// --- The contract, on the embedded default (memory) -----------------------------------------

#[tokio::test]
async fn creates_a_charge_with_etag_location_and_json_then_reads_it() {
    let server = Launch::new().start().await;
    let lines = server.wait_for_log("listening on").await;
    assert_eq!(lines.len(), 1, "one line at start: {lines:#?}");
    assert!(
        lines[0].contains(&format!("http://{}", server.addr)),
        "{}",
        lines[0]
    );
    assert!(
        lines[0].contains("payments: memory, idempotency: memory"),
        "{}",
        lines[0]
    );

    let created = server.charge(&Charge::new(&unique(), "alice")).await;
    assert_eq!(created.status, StatusCode::CREATED);
    assert_eq!(
        created.header(header::CONTENT_TYPE),
        Some("application/json")
    );
    assert_eq!(
        created.header(header::ETAG),
        Some("\"1\""),
        "a strong ETag of version 1"
    );
    let body = created.json();
    let id = payment_id(&created);
    assert!(!id.is_empty());
    assert_eq!(
        body,
        serde_json::json!({"id": id, "amount": 1200, "currency": "EUR", "status": "pending", "version": 1})
    );
    let location = format!("/payments/{id}");
    assert_eq!(created.header(header::LOCATION), Some(location.as_str()));
    assert_eq!(server.charges().await, 1);

    let read = server.get(&location).await;
    assert_eq!(read.status, StatusCode::OK);
    assert_eq!(read.json(), body);
    assert_eq!(read.header(header::ETAG), Some("\"1\""));

    server
        .get("/payments/pay_0000000000000000")
        .await
        .assert_problem(StatusCode::NOT_FOUND);
    assert_eq!(server.charges().await, 1);
}

#[tokio::test]
async fn metrics_count_one_executed_and_one_replayed_request() {
    let server = Launch::new().start().await;
    server.wait_for_log("listening on").await;
    let charge = Charge::new(&unique(), "alice");
    let first = server.charge(&charge).await;
    let again = server.charge(&charge).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(again.identity(), first.identity(), "the retry is a replay");

    let scraped = server.get("/metrics").await;
    assert_eq!(scraped.status, StatusCode::OK);
    let text = String::from_utf8(scraped.body.to_vec()).expect("Prometheus text is UTF-8");
    // The value of the series `name{label="value"}` in the scraped text.
    let series = |name: &str, label: &str, value: &str| {
        let series = format!("{name}{{{label}=\"{value}\"}} ");
        text.lines()
            .find_map(|line| line.strip_prefix(series.as_str()))
            .unwrap_or_else(|| panic!("no {series}in:\n{text}"))
            .trim()
            .to_owned()
    };
    let count = |outcome: &str| series(tower_idempotency::metrics::REQUESTS, "outcome", outcome);
    assert_eq!(count(tower_idempotency::metrics::EXECUTED), "1");
    assert_eq!(count(tower_idempotency::metrics::REPLAYED), "1");
    // Each request claimed once (the retry's claim found the record); one completed.
    let latency = format!("{}_count", tower_idempotency::metrics::STORE_SECONDS);
    let timed = |operation: &str| series(&latency, "operation", operation);
    assert_eq!(timed("claim"), "2");
    assert_eq!(timed("complete"), "1");
    assert_eq!(server.charges().await, 1);
}

#[tokio::test]
async fn a_missing_or_malformed_key_is_400_and_charges_nothing() {
    let server = Launch::new().start().await;
    let charge = Charge::new("unused", "alice");

    server
        .charge(&charge.clone().without_key())
        .await
        .assert_problem(StatusCode::BAD_REQUEST);
    for malformed in ["", "has space", &"k".repeat(256), "caf\u{e9}"] {
        let reply = server.charge(&charge.clone().key(malformed)).await;
        reply.assert_problem(StatusCode::BAD_REQUEST);
    }
    assert_eq!(server.charges().await, 0);
}

#[tokio::test]
async fn an_invalid_body_is_422_records_nothing_and_the_key_stays_usable() {
    let server = Launch::new().start().await;
    let key = unique();
    for invalid in [
        r#"{"amount": 0, "currency": "EUR"}"#,
        r#"{"amount": 1000001, "currency": "EUR"}"#,
        r#"{"amount": 12.5, "currency": "EUR"}"#,
        r#"{"amount": 1200, "currency": "eur"}"#,
        r#"{"amount": 1200}"#,
        "not json",
    ] {
        let reply = server
            .charge(&Charge::new(&key, "alice").body(invalid))
            .await;
        reply.assert_problem(StatusCode::UNPROCESSABLE_ENTITY);
    }
    assert_eq!(server.charges().await, 0, "a rejected body charges nothing");

    // The 422 was not stored: the client fixes its body and retries under the same key.
    let fixed = server.charge(&Charge::new(&key, "alice")).await;
    assert_eq!(fixed.status, StatusCode::CREATED);
    assert_eq!(server.charges().await, 1);
}

#[tokio::test]
async fn the_same_key_replays_identically_and_another_body_is_422() {
    let server = Launch::new().start().await;
    let charge = Charge::new(&unique(), "alice");

    let first = server.charge(&charge).await;
    assert_eq!(first.status, StatusCode::CREATED);
    for _ in 0..3 {
        assert_eq!(server.charge(&charge).await.identity(), first.identity());
    }
    let other = charge
        .clone()
        .body(r#"{"amount": 1300, "currency": "EUR"}"#);
    server
        .charge(&other)
        .await
        .assert_problem(StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(server.charges().await, 1);
    // The mismatch did not disturb the stored answer.
    assert_eq!(server.charge(&charge).await.identity(), first.identity());
}

#[tokio::test]
async fn keys_are_scoped_by_caller() {
    let server = Launch::new().start().await;
    let key = unique();

    let alice = server.charge(&Charge::new(&key, "alice")).await;
    let bob = server.charge(&Charge::new(&key, "bob")).await;
    for reply in [&alice, &bob] {
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    let ids: HashSet<_> = [&alice, &bob].map(payment_id).into_iter().collect();
    assert_eq!(ids.len(), 2, "one key, two callers, two payments");
    assert_eq!(server.charges().await, 2);

    // No caller: 401, nothing charged or recorded (never a scope shared by anonymous callers).
    for _ in 0..2 {
        let anonymous = server.charge(&Charge::new(&key, "").without_caller()).await;
        anonymous.assert_problem(StatusCode::UNAUTHORIZED);
    }
    assert_eq!(server.charges().await, 2);

    // Each caller replays its own payment, never another caller's.
    assert_eq!(
        server.charge(&Charge::new(&key, "alice")).await.identity(),
        alice.identity()
    );
    assert_eq!(
        server.charge(&Charge::new(&key, "bob")).await.identity(),
        bob.identity()
    );
    assert_eq!(server.charges().await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_charge_once_and_all_get_the_same_answer() {
    let server = Launch::new()
        .env("PAYMENTS_HANDLER_DELAY_MS", 300)
        .start()
        .await;
    let replies = storm(&[server.http()], &Charge::new(&unique(), "alice"), 40).await;
    one_created(&replies);
    assert_eq!(server.charges().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_layer_duplicates_charge_again() {
    // The baseline that makes the test above meaningful: the handler itself has no guard.
    let server = Launch::new()
        .env("IDEMPOTENCY_DISABLED", 1)
        .env("PAYMENTS_HANDLER_DELAY_MS", 200)
        .start()
        .await;
    server.wait_for_log("DISABLED").await;
    let replies = storm(&[server.http()], &Charge::new(&unique(), "alice"), 10).await;
    assert!(replies.iter().all(|r| r.status == StatusCode::CREATED));
    let ids: HashSet<_> = replies.iter().map(payment_id).collect();
    assert_eq!(ids.len(), 10);
    assert_eq!(server.charges().await, 10);
}

#[tokio::test]
async fn processor_failures_record_nothing_and_the_retry_succeeds() {
    let server = Launch::new().env("PAYMENTS_FAIL_FIRST", 2).start().await;
    let charge = Charge::new(&unique(), "alice");

    for _ in 0..2 {
        server
            .charge(&charge)
            .await
            .assert_problem(StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(server.charges().await, 0);
    }
    // A 503 is not final: the same key runs again, and this time the processor answers.
    let created = server.charge(&charge).await;
    assert_eq!(created.status, StatusCode::CREATED);
    assert_eq!(server.charge(&charge).await.identity(), created.identity());
    assert_eq!(server.charges().await, 1);
}

#[tokio::test]
async fn sigterm_lets_the_running_request_finish_and_exits_0() {
    let server = Launch::new()
        .env("PAYMENTS_HANDLER_DELAY_MS", 500)
        .start()
        .await;
    let http = server.http();
    let in_flight =
        tokio::spawn(async move { http.charge(&Charge::new(&unique(), "alice")).await });
    tokio::time::sleep(Duration::from_millis(150)).await;

    let status = server.terminate().await;
    assert_eq!(status.code(), Some(0), "{status}");
    let reply = in_flight.await.expect("the request task");
    assert_eq!(
        reply.status,
        StatusCode::CREATED,
        "the request running at SIGTERM completes"
    );
}

// --- Several processes on one database -------------------------------------------------------

/// Two processes started at the same moment (their migrations race) on one database;
/// 16 copies of each of 10 keys arrive together, spread over both: exactly one charge per key.
async fn two_processes_are_one_service(shared: Shared) {
    const KEYS: usize = 10;
    const COPIES: usize = 16;
    let launch = Launch::new()
        .envs(&shared.env())
        .env("PAYMENTS_HANDLER_DELAY_MS", 200);
    let (a, b) = tokio::join!(launch.clone().start(), launch.start());
    let backend = shared.name();
    a.wait_for_log(&format!("idempotency: {backend}")).await;

    let servers = [a.http(), b.http()];
    let caller = unique();
    let storms = (0..KEYS).map(|k| {
        let charge = Charge::new(&format!("key-{k}-{}", unique()), &caller);
        let servers = servers.clone();
        async move { storm(&servers, &charge, COPIES).await }
    });
    let results = futures_util::future::join_all(storms).await;

    let ids: HashSet<_> = results
        .iter()
        .map(|replies| payment_id(one_created(replies)))
        .collect();
    assert_eq!(ids.len(), KEYS, "{backend}: one payment per key");
    // Either process reads every payment: they live in the shared database.
    for replies in &results {
        let location = replies[0].header(header::LOCATION).expect("Location");
        for server in [&a, &b] {
            let read = server.get(location).await;
            assert_eq!(read.status, StatusCode::OK, "{backend}: GET {location}");
            assert_eq!(read.json(), replies[0].json());
        }
    }
    assert_eq!(
        shared.charge_rows().await,
        KEYS as i64,
        "{backend}: charge rows"
    );
    assert_eq!(a.charges().await, KEYS as u64);
    assert_eq!(b.charges().await, KEYS as u64);
}

/// Process A claims a key and dies (SIGKILL) in the middle of its handler, before charging.
/// The same request to process B waits for A's lease to run out, takes the key over and
/// charges exactly once. (The separate mode: in the transactional one no lease is involved,
/// see tests/payments_crash.rs.)
async fn a_killed_owner_is_taken_over_after_its_lease(shared: Shared) {
    let env = shared.env();
    let lease = |launch: Launch| {
        launch
            .envs(&env)
            .env("IDEMPOTENCY_MODE", "separate")
            .env("IDEMPOTENCY_LEASE_MS", 1_000)
    };
    let (a, b) = tokio::join!(
        lease(Launch::new())
            .env("PAYMENTS_HANDLER_DELAY_MS", 60_000)
            .start(),
        lease(Launch::new()).start(),
    );
    let backend = shared.name();
    let charge = Charge::new(&unique(), &unique());

    let http = a.http();
    let on_a = {
        let charge = charge.clone();
        tokio::spawn(async move { http.try_charge(&charge).await })
    };
    // A claims at once, then sleeps in its handler. B sees that claim in the shared store:
    // the same key with another body is refused while A runs.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let other = charge.clone().body(r#"{"amount": 1, "currency": "EUR"}"#);
    b.charge(&other)
        .await
        .assert_problem(StatusCode::UNPROCESSABLE_ENTITY);

    a.kill_9().await;
    assert!(
        on_a.await.expect("task").is_err(),
        "A died without answering"
    );
    assert_eq!(
        shared.charge_rows().await,
        0,
        "{backend}: A died before charging"
    );

    let taken_over = b.charge(&charge).await;
    assert_eq!(
        taken_over.status,
        StatusCode::CREATED,
        "{backend}: {:?}",
        taken_over.body
    );
    assert_eq!(b.charge(&charge).await.identity(), taken_over.identity());
    assert_eq!(
        shared.charge_rows().await,
        1,
        "{backend}: exactly one charge"
    );
    assert_eq!(b.charges().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_two_processes_are_one_service() {
    if let Some(shared) = Shared::postgres().await {
        shared.run(two_processes_are_one_service).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_killed_owner_is_taken_over_after_its_lease() {
    if let Some(shared) = Shared::postgres().await {
        shared
            .run(a_killed_owner_is_taken_over_after_its_lease)
            .await;
    }
}

/// Transactional mode on PostgreSQL: the database ends the owner's session (an operator's
/// `pg_terminate_backend`, a failover) while its handler waits before charging. The charge's
/// `INSERT` meets the ended session and nothing is charged, so the answer is what a retry can
/// fix — 503 with `Retry-After`, not 500 — and the retry charges once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_charge_on_an_ended_session_is_503_and_the_retry_charges_once() {
    let Some(shared) = Shared::postgres().await else {
        return;
    };
    shared
        .run(|shared| async move {
            let Shared::Postgres { admin, .. } = &shared else {
                unreachable!("a PostgreSQL share")
            };
            // The example's sessions carry a name of their own, to end the owner's alone.
            let name = format!("payments_{}", unique());
            let env: Vec<(String, String)> = shared
                .env()
                .into_iter()
                .map(|(var, value)| match var.as_str() {
                    "DATABASE_URL" => (var, format!("{value}&application_name={name}")),
                    _ => (var, value),
                })
                .collect();
            let server = Launch::new()
                .envs(&env)
                .env("IDEMPOTENCY_MODE", "transactional")
                .env("PAYMENTS_HANDLER_DELAY_MS", 1_500)
                .start()
                .await;
            let charge = Charge::new(&unique(), &unique());
            let first = {
                let (http, charge) = (server.http(), charge.clone());
                tokio::spawn(async move { http.charge(&charge).await })
            };
            // The owner's transaction is open while its handler sleeps: end its session.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            loop {
                let ended: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
                     WHERE application_name = $1 AND state = 'idle in transaction'",
                )
                .bind(&name)
                .fetch_one(admin)
                .await
                .expect("end the owner's session");
                if ended > 0 {
                    break;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the owner never sat in its transaction"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let reply = first.await.expect("the first request's task");
            reply.assert_problem(StatusCode::SERVICE_UNAVAILABLE);
            assert!(
                reply.header(header::RETRY_AFTER).is_some(),
                "{:?}",
                reply.headers
            );
            assert_eq!(shared.charge_rows().await, 0, "nothing was charged");

            let retry = server.charge(&charge).await;
            assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
            assert_eq!(shared.charge_rows().await, 1, "the retry charged once");
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_two_processes_are_one_service() {
    if let Some(shared) = Shared::mysql().await {
        shared.run(two_processes_are_one_service).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_killed_owner_is_taken_over_after_its_lease() {
    if let Some(shared) = Shared::mysql().await {
        shared
            .run(a_killed_owner_is_taken_over_after_its_lease)
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_two_processes_are_one_service() {
    Shared::sqlite().run(two_processes_are_one_service).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_killed_owner_is_taken_over_after_its_lease() {
    Shared::sqlite()
        .run(a_killed_owner_is_taken_over_after_its_lease)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_two_processes_are_one_service() {
    if let Some(shared) = Shared::redis() {
        shared.run(two_processes_are_one_service).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_killed_owner_is_taken_over_after_its_lease() {
    if let Some(shared) = Shared::redis() {
        shared
            .run(a_killed_owner_is_taken_over_after_its_lease)
            .await;
    }
}

/// Transactional mode, two processes on one PostgreSQL: 64 copies of each of 4 keys arrive
/// together while unrelated keys keep coming. Waiting copies hold no database connection
/// (the example's pools have 10), so the unrelated keys are charged during the storm, every
/// copy gets its key's one answer, and nothing times out.
async fn transactional_storm_leaves_other_keys_flowing(shared: Shared) {
    const KEYS: usize = 4;
    const COPIES: usize = 64;
    const UNRELATED: usize = 20;
    let launch = Launch::new()
        .envs(&shared.env())
        .env("IDEMPOTENCY_MODE", "transactional")
        .env("PAYMENTS_HANDLER_DELAY_MS", 300);
    let (a, b) = tokio::join!(launch.clone().start(), launch.start());
    let backend = shared.name();
    a.wait_for_log("mode: transactional").await;
    let servers = [a.http(), b.http()];
    let caller = unique();

    let storms = futures_util::future::join_all((0..KEYS).map(|k| {
        let charge = Charge::new(&format!("storm-{k}-{}", unique()), &caller);
        let servers = servers.clone();
        async move { storm(&servers, &charge, COPIES).await }
    }));
    let flow = {
        let (servers, caller) = (servers.clone(), caller.clone());
        async move {
            let mut replies = Vec::new();
            for i in 0..UNRELATED {
                let charge = Charge::new(&format!("flow-{i}-{}", unique()), &caller);
                replies.push(servers[i % 2].charge(&charge).await);
            }
            replies
        }
    };
    let (storms, flow) = tokio::join!(storms, flow);
    for replies in &storms {
        one_created(replies);
    }
    for reply in &flow {
        assert_eq!(
            reply.status,
            StatusCode::CREATED,
            "{backend}: unrelated key: {:?}",
            reply.body
        );
    }
    assert_eq!(
        shared.charge_rows().await,
        (KEYS + UNRELATED) as i64,
        "{backend}: one charge per key"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_transactional_storm_leaves_other_keys_flowing() {
    if let Some(shared) = Shared::postgres().await {
        shared
            .run(transactional_storm_leaves_other_keys_flowing)
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_transactional_storm_leaves_other_keys_flowing() {
    if let Some(shared) = Shared::mysql().await {
        shared
            .run(transactional_storm_leaves_other_keys_flowing)
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_two_processes_are_one_service() {
    if let Some(shared) = Shared::redis_cluster() {
        shared.run(two_processes_are_one_service).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_a_killed_owner_is_taken_over_after_its_lease() {
    if let Some(shared) = Shared::redis_cluster() {
        shared
            .run(a_killed_owner_is_taken_over_after_its_lease)
            .await;
    }
}

/// Transactional mode, two processes on one SQLite file: 40 new keys × 10 copies at once with
/// a 150 ms handler. SQLite has one writer, so the 40 owners run one after another (6 s in
/// all, more than the 5 s store timeout): a busy database is not an unavailable one. Every
/// copy ends `201` (the key's one answer) or `409` with `Retry-After` (come back later), never
/// `503`; retrying each `409` ends in the key's `201`, and every key is charged exactly once.
async fn sqlite_storm_of_new_keys_waits_its_turn(shared: Shared) {
    const KEYS: usize = 40;
    const COPIES: usize = 10;
    let launch = Launch::new()
        .envs(&shared.env())
        .env("IDEMPOTENCY_MODE", "transactional")
        .env("PAYMENTS_HANDLER_DELAY_MS", 150);
    let (a, b) = tokio::join!(launch.clone().start(), launch.start());
    a.wait_for_log("mode: transactional").await;
    let servers = [a.http(), b.http()];
    let caller = unique();
    let charges: Vec<Charge> = (0..KEYS)
        .map(|k| Charge::new(&format!("sqlite-storm-{k}-{}", unique()), &caller))
        .collect();

    let storms = futures_util::future::join_all(
        charges.iter().map(|charge| storm(&servers, charge, COPIES)),
    )
    .await;
    let mut busy = 0;
    for (charge, replies) in charges.iter().zip(&storms) {
        let mut created = None;
        for reply in replies {
            match reply.status {
                StatusCode::CREATED => {
                    let identity = reply.identity();
                    assert_eq!(created.get_or_insert(identity.clone()), &identity);
                }
                StatusCode::CONFLICT => {
                    assert!(
                        reply.header(header::RETRY_AFTER).is_some(),
                        "a 409 says when to come back: {:?}",
                        reply.body
                    );
                    busy += 1;
                }
                status => panic!("only 201 or 409 in a storm, got {status}: {:?}", reply.body),
            }
        }
        // The client's retry learns the key's one answer.
        let retried = loop {
            let reply = servers[0].charge(charge).await;
            if reply.status != StatusCode::CONFLICT {
                break reply;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(retried.status, StatusCode::CREATED, "{:?}", retried.body);
        if let Some(created) = created {
            assert_eq!(
                retried.identity(),
                created,
                "the retry replays the key's answer"
            );
        }
    }
    println!(
        "sqlite storm: {busy} of {} copies answered 409",
        KEYS * COPIES
    );
    assert_eq!(
        shared.charge_rows().await,
        KEYS as i64,
        "one charge per key"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_transactional_storm_of_new_keys_waits_its_turn() {
    Shared::sqlite()
        .run(sqlite_storm_of_new_keys_waits_its_turn)
        .await;
}
