//! An example that serves no HTTP (the `receipts` consumer, the `outbox_relay`) as a real
//! process: started with an environment, watched through its log, killed or stopped.

use std::{process::Stdio, time::Duration};

use tokio::process::{Child, Command};

use super::{example_binary, Logs, PATIENCE};

/// A running example process; dropping it kills the process.
pub struct Worker {
    child: Child,
    pub logs: Logs,
}

impl Worker {
    /// Starts example `name` with only `env` (plus `PATH`) and waits for a log line
    /// containing `ready`.
    pub async fn start(name: &str, env: &[(String, String)], ready: &str) -> Self {
        let mut child = Command::new(example_binary(name))
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("NO_COLOR", "1")
            .env("RUST_LOG", "info,sqlx=warn")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn the {name} example: {e}"));
        let logs = Logs::default();
        logs.collect(child.stdout.take().expect("piped stdout"));
        logs.collect(child.stderr.take().expect("piped stderr"));
        let mut worker = Self { child, logs };
        worker.wait_for_log(ready).await;
        worker
    }

    /// Waits until a log line contains `text`; fails if the process exits first.
    pub async fn wait_for_log(&mut self, text: &str) {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            if self.logs.lines().iter().any(|line| line.contains(text)) {
                return;
            }
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                tokio::time::sleep(Duration::from_millis(100)).await;
                panic!(
                    "the example exited with {status} before logging {text:?}:\n{}",
                    self.logs.lines().join("\n")
                );
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no log line contains {text:?} after {PATIENCE:?}:\n{}",
                self.logs.lines().join("\n")
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL: the process dies on the spot, whatever it was doing.
    pub async fn kill_9(mut self) {
        self.child.start_kill().expect("SIGKILL");
        self.child.wait().await.expect("wait");
    }

    /// How the process ended, if it did (nobody killed it: it gave up by itself).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().expect("try_wait")
    }

    /// SIGTERM, then waits for the exit; returns whether it exited successfully.
    pub async fn terminate(mut self) -> bool {
        let pid = self.child.id().expect("running").to_string();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -TERM failed");
        tokio::time::timeout(PATIENCE, self.child.wait())
            .await
            .expect("the example did not exit after SIGTERM")
            .expect("wait")
            .success()
    }
}
