//! `examples/loadgen` against a real `payments` process, at a size a test can afford: its
//! verdict holds when the layer is on, and FAILS when the layer is off — so the verdict that
//! `scripts/bench` relies on can tell the difference.
//!
//! Both binaries are the ones `cargo test` builds next to the test binaries
//! (`target/<profile>/examples/`). `cargo test --test loadgen_smoke` alone does not build
//! examples: run `cargo build --examples` first in that case.

use std::{
    net::{TcpListener, TcpStream},
    path::PathBuf,
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

/// How long the example may take to start listening before the test gives up (a bound on a
/// hang, not a measurement).
const PATIENCE: Duration = Duration::from_secs(30);

/// Every variable of the example's contract, cleared so the developer's shell cannot leak a
/// `DATABASE_URL` into the test.
const CONTRACT_VARS: [&str; 9] = [
    "BIND",
    "DATABASE_URL",
    "REDIS_URL",
    "IDEMPOTENCY_LEASE_MS",
    "IDEMPOTENCY_TTL_SECS",
    "IDEMPOTENCY_DISABLED",
    "PAYMENTS_HANDLER_DELAY_MS",
    "PAYMENTS_FAIL_FIRST",
    "RUST_LOG",
];

/// `target/<profile>/examples/<name>`, next to this test binary's `deps/` folder.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let path = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps")
        .join("examples")
        .join(name);
    assert!(
        path.exists(),
        "{} does not exist: run `cargo test` (which builds the examples) or `cargo build --examples`",
        path.display()
    );
    path
}

/// A port nobody listens on right now (the example binds its address itself).
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local_addr").port()
}

/// A running `payments` process, killed when dropped (also when the test fails).
struct Payments {
    child: Child,
    url: String,
}

impl Payments {
    fn start(env: &[(&str, &str)]) -> Self {
        let port = free_port();
        let mut command = Command::new(example("payments"));
        for var in CONTRACT_VARS {
            command.env_remove(var);
        }
        command
            .env("BIND", format!("127.0.0.1:{port}"))
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = command.spawn().expect("start the payments example");
        let payments = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        let started = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < PATIENCE,
                "payments did not listen on {port} within {PATIENCE:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        payments
    }
}

impl Drop for Payments {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn loadgen(args: &[&str]) -> (Output, String) {
    let output = Command::new(example("loadgen"))
        .args(args)
        .output()
        .expect("run loadgen");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    (output, stdout)
}

fn verdict(stdout: &str) -> &str {
    stdout
        .lines()
        .find(|line| line.starts_with("verdict: "))
        .unwrap_or_else(|| panic!("loadgen printed no verdict:\n{stdout}"))
}

/// 20 keys, each sent as 8 copies at once, while the handler takes a while: every copy
/// after the first waits for the original and replays it; one charge per key.
#[test]
fn duplicates_execute_once_and_the_verdict_says_ok() {
    let payments = Payments::start(&[("PAYMENTS_HANDLER_DELAY_MS", "20")]);
    let (output, stdout) = loadgen(&[
        "--target",
        &payments.url,
        "--requests",
        "160",
        "--duplicates",
        "8",
        "--concurrency",
        "4",
    ]);
    assert!(
        output.status.success(),
        "loadgen failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(
        verdict(&stdout),
        "verdict: OK: charges 20 = keys 20; every copy of a key answered identically"
    );
    assert!(stdout.contains("statuses: 201 x 160"), "{stdout}");
}

/// The same load with the layer switched off: every copy charges, and loadgen must say so.
#[test]
fn without_the_layer_the_verdict_fails() {
    let payments = Payments::start(&[
        ("IDEMPOTENCY_DISABLED", "1"),
        ("PAYMENTS_HANDLER_DELAY_MS", "20"),
    ]);
    let (output, stdout) = loadgen(&[
        "--target",
        &payments.url,
        "--requests",
        "160",
        "--duplicates",
        "8",
        "--concurrency",
        "4",
    ]);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    let verdict = verdict(&stdout);
    assert!(
        verdict.starts_with("verdict: FAIL: charges 160 != keys 20"),
        "{verdict}"
    );
    assert!(
        verdict.contains("answers that break the contract"),
        "{verdict}"
    );
}

/// A target that does not answer is a setup error (exit 2), not a verdict.
#[test]
fn an_unreachable_target_is_not_a_verdict() {
    let (output, stdout) = loadgen(&[
        "--target",
        &format!("http://127.0.0.1:{}", free_port()),
        "--requests",
        "1",
    ]);
    assert_eq!(output.status.code(), Some(2), "{stdout}");
    assert!(!stdout.contains("verdict:"), "{stdout}");
}
