//! A consumer as a real process, for tests that SIGKILL it: the test binary runs itself with
//! one `#[ignore]`d test selected (`--exact NAME --ignored`), which reads its orders from
//! the environment, and prints one line per event the parent waits for.

use std::{
    process::Stdio,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
};

/// The variable that tells the child test it was started by a parent (and what to do).
pub const ROLE: &str = "BROKER_TEST_CHILD";

/// A running child; dropping it kills the process.
pub struct ChildProcess {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl ChildProcess {
    /// Runs test `name` of this test binary in a process of its own with `env` added.
    pub fn start(name: &str, env: &[(&str, String)]) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("current_exe"))
            .args([
                "--exact",
                name,
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the child test process");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stdout = child.stdout.take().expect("piped stdout");
        let collected = lines.clone();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                collected
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(line);
            }
        });
        Self { child, lines }
    }

    /// The lines printed so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Waits (at most `limit`) until `count` lines contain `prefix`.
    pub async fn wait_for(&mut self, prefix: &str, count: usize, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let seen = self
                .lines()
                .iter()
                .filter(|l| l.starts_with(prefix))
                .count();
            if seen >= count {
                return;
            }
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                panic!("the child exited with {status} before printing {prefix:?} x{count}");
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{prefix:?} printed {seen} times of {count} after {limit:?}: {:?}",
                self.lines()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL: the process dies on the spot, its transaction and its deliveries open.
    pub async fn kill_9(mut self) {
        self.child.start_kill().expect("SIGKILL");
        self.child.wait().await.expect("wait");
    }
}

/// In the child: prints an event line the parent waits for (stdout is a pipe: flush now).
pub fn say(line: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{line}");
    let _ = stdout.flush();
}
