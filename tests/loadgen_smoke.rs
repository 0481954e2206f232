//! `examples/loadgen` against real `payments` processes, at a size a test can afford: its
//! verdict holds when the layer is on (one process, and two processes on one PostgreSQL), it
//! FAILS when the layer is off — so the verdict `scripts/bench` relies on can tell the
//! difference — and its If-Match storm finds exactly one winner per version.
//!
//! Both binaries are built on demand (`tests/common/example_binary.rs`), so this runs the
//! same under `cargo test` and `cargo test --test loadgen_smoke` on a fresh clone.

mod process;

use std::process::Output;

use process::{shared::Shared, Launch, Server};

fn target(server: &Server) -> String {
    format!("http://{}", server.addr)
}

/// Runs loadgen to the end; its output, and stdout as text.
async fn loadgen(args: &[&str]) -> (Output, String) {
    let output = tokio::process::Command::new(process::example_binary("loadgen"))
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .expect("run loadgen");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    (output, stdout)
}

fn assert_success(output: &Output, stdout: &str) {
    assert!(
        output.status.success(),
        "loadgen failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}

fn line<'a>(stdout: &'a str, prefix: &str) -> &'a str {
    stdout
        .lines()
        .find(|line| line.starts_with(prefix))
        .unwrap_or_else(|| panic!("loadgen printed no {prefix:?} line:\n{stdout}"))
}

/// 20 keys x 8 copies, sent together while the handler takes a while.
const STORM: [&str; 6] = [
    "--requests",
    "160",
    "--duplicates",
    "8",
    "--concurrency",
    "4",
];

/// Every copy after the first waits for the original and replays it: one charge per key.
#[tokio::test(flavor = "multi_thread")]
async fn duplicates_execute_once_and_the_verdict_says_ok() {
    let server = Launch::new()
        .env("PAYMENTS_HANDLER_DELAY_MS", 20)
        .start()
        .await;
    let (output, stdout) = loadgen(&[&["--target", &target(&server)], &STORM[..]].concat()).await;
    assert_success(&output, &stdout);
    assert_eq!(
        line(&stdout, "verdict: "),
        "verdict: OK: charges 20 = keys 20; every copy of a key answered identically"
    );
    assert_eq!(line(&stdout, "statuses: "), "statuses: 201 x 160");
}

/// The same load with the layer switched off: every copy charges, and loadgen must say so.
#[tokio::test(flavor = "multi_thread")]
async fn without_the_layer_the_verdict_fails() {
    let server = Launch::new()
        .env("IDEMPOTENCY_DISABLED", 1)
        .env("PAYMENTS_HANDLER_DELAY_MS", 20)
        .start()
        .await;
    let (output, stdout) = loadgen(&[&["--target", &target(&server)], &STORM[..]].concat()).await;
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    let verdict = line(&stdout, "verdict: ");
    assert!(
        verdict.starts_with("verdict: FAIL: charges 160 != keys 20"),
        "{verdict}"
    );
    assert!(
        verdict.contains("answers that break the contract"),
        "{verdict}"
    );
}

/// Two processes on one PostgreSQL schema, the copies of each key spread over both: the
/// waiters in the other process poll the shared store, and still one charge per key — by
/// loadgen's count and by the database's own.
#[tokio::test(flavor = "multi_thread")]
async fn two_processes_on_one_postgres_execute_each_key_once() {
    let Some(shared) = Shared::postgres().await else {
        return;
    };
    shared
        .run(|shared| async move {
            let env = shared.env();
            let start = || {
                Launch::new()
                    .envs(&env)
                    .env("PAYMENTS_HANDLER_DELAY_MS", 20)
                    .start()
            };
            let (a, b) = (start().await, start().await);
            let targets = ["--target", &target(&a), "--target", &target(&b)];
            let (output, stdout) = loadgen(&[&targets[..], &STORM[..]].concat()).await;
            assert_success(&output, &stdout);
            assert!(
                line(&stdout, "verdict: ").starts_with("verdict: OK: charges 20 = keys 20"),
                "{stdout}"
            );
            assert_eq!(shared.charge_rows().await, 20);
        })
        .await;
}

/// 8 concurrent PATCHes with the same `If-Match`, 5 times in a row: one 200 each time.
#[tokio::test(flavor = "multi_thread")]
async fn an_if_match_storm_has_exactly_one_winner_per_version() {
    let server = Launch::new().start().await;
    let (output, stdout) = loadgen(&[
        "--target",
        &target(&server),
        "--patch-mix",
        "1",
        "--patch-without-key",
        "--duplicates",
        "8",
        "--concurrency",
        "1",
        "--requests",
        "40",
    ])
    .await;
    assert_success(&output, &stdout);
    assert_eq!(
        line(&stdout, "patch: "),
        "patch: 5 operations, 5 with exactly one 200 (the rest 412)"
    );
    assert_eq!(line(&stdout, "statuses: "), "statuses: 200 x 5, 412 x 35");
}

/// A target that does not answer is a setup error (exit 2), not a verdict.
#[tokio::test]
async fn an_unreachable_target_is_not_a_verdict() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port();
    let (output, stdout) = loadgen(&[
        "--target",
        &format!("http://127.0.0.1:{port}"),
        "--requests",
        "1",
    ])
    .await;
    assert_eq!(output.status.code(), Some(2), "{stdout}");
    assert!(!stdout.contains("verdict:"), "{stdout}");
}
