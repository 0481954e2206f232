//! The payments example's `PATCH /payments/{id}` as a black box: If-Match preconditions,
//! one compare-and-set per update, and its composition with the idempotency layer.

mod process;

use std::sync::Arc;

use http::{header, Method, StatusCode};
use process::{shared::Shared, unique, Charge, Http, Launch, Reply};
use tokio::{sync::Barrier, task::JoinSet};

async fn patch(http: &Http, path: &str, headers: &[(&str, &str)], status: &str) -> Reply {
    let body = format!(r#"{{"status":"{status}"}}"#);
    let with_caller: Vec<_> = [("authorization", "Bearer alice")]
        .into_iter()
        .chain(headers.iter().copied())
        .collect();
    http.send(Method::PATCH, path, &with_caller, &body).await
}

/// Creates a payment and returns its path.
async fn create(http: &Http) -> String {
    let created = http.charge(&Charge::new(&unique(), "alice")).await;
    assert_eq!(created.status, StatusCode::CREATED);
    created
        .header(header::LOCATION)
        .expect("Location")
        .to_owned()
}

fn problem_type(reply: &Reply) -> String {
    reply.json()["type"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn if_match_rules_of_the_patch_route() {
    let server = Launch::new().start().await;
    let http = server.http();
    let path = create(&http).await;

    let missing = patch(&http, &path, &[], "paid").await;
    missing.assert_problem(StatusCode::PRECONDITION_REQUIRED);

    // No caller: 401 before anything else, and nothing changes.
    let anonymous = http
        .send(
            Method::PATCH,
            &path,
            &[("if-match", "\"1\""), ("idempotency-key", "anon")],
            r#"{"status":"paid"}"#,
        )
        .await;
    anonymous.assert_problem(StatusCode::UNAUTHORIZED);
    assert_eq!(http.get(&path).await.json()["status"], "pending");

    let garbage = patch(&http, &path, &[("if-match", "abc")], "paid").await;
    garbage.assert_problem(StatusCode::BAD_REQUEST);

    // Strong comparison: a weak tag never matches, even of the right version.
    let weak = patch(&http, &path, &[("if-match", "W/\"1\"")], "paid").await;
    weak.assert_problem(StatusCode::PRECONDITION_FAILED);

    let paid = patch(&http, &path, &[("if-match", "\"1\"")], "paid").await;
    assert_eq!(paid.status, StatusCode::OK);
    assert_eq!(paid.header(header::ETAG), Some("\"2\""));
    assert_eq!(paid.json()["status"], "paid");
    assert_eq!(paid.json()["version"], 2);

    // Stale: 412 carrying the CURRENT ETag, and nothing changed.
    let stale = patch(&http, &path, &[("if-match", "\"1\"")], "failed").await;
    stale.assert_problem(StatusCode::PRECONDITION_FAILED);
    assert_eq!(stale.header(header::ETAG), Some("\"2\""));
    assert_eq!(http.get(&path).await.json()["status"], "paid");

    // A list matches when any member does; so do several header lines.
    let listed = patch(&http, &path, &[("if-match", "\"7\", \"2\"")], "refunded").await;
    assert_eq!(listed.header(header::ETAG), Some("\"3\""));
    let lines = patch(
        &http,
        &path,
        &[("if-match", "\"9\""), ("if-match", "\"3\"")],
        "failed",
    )
    .await;
    assert_eq!(lines.status, StatusCode::OK);
    assert_eq!(lines.header(header::ETAG), Some("\"4\""));

    // `*` matches an existing payment.
    let any = patch(&http, &path, &[("if-match", "*")], "paid").await;
    assert_eq!(any.header(header::ETAG), Some("\"5\""));

    let nowhere = patch(
        &http,
        "/payments/pay_0000000000000000",
        &[("if-match", "\"1\"")],
        "paid",
    )
    .await;
    nowhere.assert_problem(StatusCode::NOT_FOUND);

    let invalid = patch(&http, &path, &[("if-match", "\"5\"")], "lost").await;
    invalid.assert_problem(StatusCode::UNPROCESSABLE_ENTITY);

    let read = http.get(&path).await;
    assert_eq!(read.json()["version"], 5);
    assert_eq!(read.header(header::ETAG), Some("\"5\""));
    assert_eq!(http.charges().await, 1, "updates never charge");
    assert!(
        problem_type(&stale).contains("precondition-failed"),
        "{}",
        problem_type(&stale)
    );
}

#[tokio::test]
async fn a_retried_patch_replays_its_first_answer_though_its_if_match_is_stale() {
    let server = Launch::new().start().await;
    let http = server.http();
    let path = create(&http).await;
    let key = unique();
    let headers = [("if-match", "\"1\""), ("idempotency-key", key.as_str())];
    let first = patch(&http, &path, &headers, "paid").await;
    assert_eq!(first.status, StatusCode::OK);
    // The version is now 2, so "1" is stale; the retry still gets the original 200.
    let retry = patch(&http, &path, &headers, "paid").await;
    assert_eq!(retry.identity(), first.identity());
    assert_eq!(
        http.get(&path).await.json()["version"],
        2,
        "the retry did not update again"
    );
    // Without the key the same request is a new one: 412.
    let fresh = patch(&http, &path, &[("if-match", "\"1\"")], "paid").await;
    assert_eq!(fresh.status, StatusCode::PRECONDITION_FAILED);
}

#[tokio::test]
async fn a_failed_precondition_is_not_replayed_under_its_key() {
    // 412 changed nothing, so it is not stored: the client re-reads and retries with the
    // same key and a fresh If-Match.
    let server = Launch::new().start().await;
    let http = server.http();
    let path = create(&http).await;
    patch(&http, &path, &[("if-match", "\"1\"")], "paid").await;
    let key = unique();
    let stale = patch(
        &http,
        &path,
        &[("if-match", "\"1\""), ("idempotency-key", &key)],
        "refunded",
    )
    .await;
    assert_eq!(stale.status, StatusCode::PRECONDITION_FAILED);
    let fresh = patch(
        &http,
        &path,
        &[("if-match", "\"2\""), ("idempotency-key", &key)],
        "refunded",
    )
    .await;
    assert_eq!(fresh.status, StatusCode::OK);
    assert_eq!(fresh.json()["status"], "refunded");
}

/// `copies` PATCHes holding the same version, released together, spread over `servers`:
/// exactly one wins; every loser gets 412 with the winner's ETag.
async fn if_match_storm(servers: &[Http], path: &str, copies: usize) {
    let barrier = Arc::new(Barrier::new(copies));
    let mut tasks = JoinSet::new();
    for copy in 0..copies {
        let (http, barrier, path) = (
            servers[copy % servers.len()].clone(),
            barrier.clone(),
            path.to_owned(),
        );
        let status = ["paid", "refunded", "failed"][copy % 3];
        tasks.spawn(async move {
            barrier.wait().await;
            patch(&http, &path, &[("if-match", "\"1\"")], status).await
        });
    }
    let replies = tasks.join_all().await;
    let winners: Vec<_> = replies
        .iter()
        .filter(|r| r.status == StatusCode::OK)
        .collect();
    assert_eq!(winners.len(), 1, "exactly one update may win");
    for reply in &replies {
        if reply.status != StatusCode::OK {
            assert_eq!(reply.status, StatusCode::PRECONDITION_FAILED);
            assert_eq!(
                reply.header(header::ETAG),
                Some("\"2\""),
                "losers see the winner's version"
            );
        }
    }
    let read = servers[0].get(path).await;
    assert_eq!(read.json()["version"], 2, "the version moved exactly once");
    assert_eq!(
        read.json()["status"],
        winners[0].json()["status"],
        "the winner's change is what is stored"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_patches_on_one_version_have_one_winner() {
    let server = Launch::new().start().await;
    let http = server.http();
    let path = create(&http).await;
    if_match_storm(&[http], &path, 64).await;
}

async fn two_processes_one_winner(shared: Shared) {
    let launch = Launch::new().envs(&shared.env());
    let (a, b) = tokio::join!(launch.clone().start(), launch.start());
    let path = create(&a.http()).await;
    if_match_storm(&[a.http(), b.http()], &path, 32).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_concurrent_patches_across_two_processes_have_one_winner() {
    if let Some(shared) = Shared::postgres().await {
        shared.run(two_processes_one_winner).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_concurrent_patches_across_two_processes_have_one_winner() {
    if let Some(shared) = Shared::mysql().await {
        shared.run(two_processes_one_winner).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_concurrent_patches_across_two_processes_have_one_winner() {
    Shared::sqlite().run(two_processes_one_winner).await;
}
