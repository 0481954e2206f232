//! The payments example's logs as a service ships them: written to a file (not a terminal),
//! they hold no ANSI escape codes, and with `LOG_FORMAT=json` every line is one JSON object.

#[path = "common/example_binary.rs"]
mod example_binary;

use std::{
    fs::File,
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

/// Runs the example (in-memory store) with stdout and stderr appended to one file, until it
/// has logged its start line, and returns what it wrote.
fn logs_of_a_start(log_format: Option<&str>) -> String {
    let path: PathBuf = std::env::temp_dir().join(format!(
        "tower-idempotency-payments-logs-{}-{}.log",
        std::process::id(),
        log_format.unwrap_or("text")
    ));
    let file = File::create(&path).expect("create the log file");
    let mut command = Command::new(example_binary::example_binary("payments"));
    for var in [
        "DATABASE_URL",
        "REDIS_URL",
        "REDIS_CLUSTER_URLS",
        "AMQP_URL",
        "NATS_URL",
    ] {
        command.env_remove(var);
    }
    // NO_COLOR would hide the bug under test: colours must be off because a file is no
    // terminal, not because the caller asked.
    command
        .env_remove("NO_COLOR")
        .env_remove("LOG_FORMAT")
        .env("RUST_LOG", "info")
        .env("BIND", "127.0.0.1:0")
        .stdin(Stdio::null())
        .stdout(file.try_clone().expect("clone the log file"))
        .stderr(file);
    if let Some(format) = log_format {
        command.env("LOG_FORMAT", format);
    }
    let mut child = command.spawn().expect("spawn the payments example");
    let deadline = Instant::now() + Duration::from_secs(60);
    let logs = loop {
        let logs = std::fs::read_to_string(&path).unwrap_or_default();
        if logs.contains("listening on http://") {
            break logs;
        }
        if let Some(status) = child.try_wait().expect("try_wait") {
            panic!("the example exited with {status} before listening:\n{logs}");
        }
        assert!(
            Instant::now() < deadline,
            "no start line within 60 s:\n{logs}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    child.kill().expect("kill the example");
    child.wait().expect("wait for the example");
    std::fs::remove_file(&path).ok();
    logs
}

#[test]
fn text_logs_to_a_file_hold_no_escape_codes() {
    let logs = logs_of_a_start(None);
    assert!(
        !logs.contains("\x1b["),
        "escape codes in a log file:\n{logs:?}"
    );
    assert!(logs.contains(" INFO "), "a level in plain text:\n{logs}");
}

#[test]
fn json_logs_are_one_json_object_a_line() {
    let logs = logs_of_a_start(Some("json"));
    assert!(
        !logs.contains("\x1b["),
        "escape codes in a log file:\n{logs:?}"
    );
    let mut lines = 0;
    for line in logs.lines() {
        let value: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|error| panic!("not JSON ({error}): {line:?}"));
        assert!(value.is_object(), "{line}");
        lines += 1;
    }
    assert!(
        logs.lines().any(|line| line.contains("\"level\":\"INFO\"")),
        "the start line as a JSON record:\n{logs}"
    );
    assert!(lines > 0);
}
