//! Database clusters a test owns, to fail over or partition: PostgreSQL under Patroni
//! ([`patroni`]) and a MariaDB Galera cluster ([`galera`]). Each runs its own processes on its
//! own loopback ports with its data in a temp dir, never the machine's shared servers; drop
//! kills every process and removes the dir, also when the test panicked.
#![allow(dead_code)]

pub mod galera;
pub mod patroni;

use std::{
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[path = "../common/iptables.rs"]
pub mod iptables;

/// A temp dir owned by `user` (servers refuse to run as root), removed on drop.
pub struct OwnDir {
    pub path: PathBuf,
}

impl OwnDir {
    pub fn new(what: &str, user: &User) -> Self {
        let path = std::env::temp_dir().join(format!(
            "tower-idempotency-{what}-{:016x}",
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&path).expect("create the cluster's temp dir");
        user.own(&path);
        Self { path }
    }

    /// A subdirectory, made and owned by `user`.
    pub fn sub(&self, name: &str, user: &User) -> PathBuf {
        let path = self.path.join(name);
        std::fs::create_dir_all(&path).expect("create a node's dir");
        user.own(&path);
        path
    }
}

impl Drop for OwnDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// The system user a server runs as.
#[derive(Debug, Clone, Copy)]
pub struct User {
    pub uid: u32,
    pub gid: u32,
}

impl User {
    /// The user `name` (looked up with `id`), or `None` when there is none.
    pub fn named(name: &str) -> Option<Self> {
        let id = |flag: &str| -> Option<u32> {
            let output = Command::new("id").args([flag, name]).output().ok()?;
            String::from_utf8_lossy(&output.stdout).trim().parse().ok()
        };
        Some(Self {
            uid: id("-u")?,
            gid: id("-g")?,
        })
    }

    pub fn own(&self, path: &Path) {
        std::os::unix::fs::chown(path, Some(self.uid), Some(self.gid))
            .expect("chown a cluster dir");
    }

    /// Runs `command` as this user, its output to `log`.
    pub fn spawn(&self, mut command: Command, log: &Path) -> std::io::Result<Child> {
        let out = std::fs::File::create(log)?;
        self.own(log);
        command
            .uid(self.uid)
            .gid(self.gid)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
    }
}

/// SIGKILL of `pid` (a server's main process the test did not spawn itself).
pub fn kill_9(pid: u32) {
    let _ = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

/// SIGKILL of a child, and its reaping.
pub fn kill_child(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// The status of `GET path` on 127.0.0.1:`port` (HTTP/1.0, no keep-alive), or `None` when
/// nothing answers within a second.
pub async fn http_status(port: u16, path: &str) -> Option<u16> {
    http_get(port, path).await.map(|(status, _)| status)
}

/// The status and body of `GET path` on 127.0.0.1:`port` (HTTP/1.0: the server closes the
/// connection after the body), or `None` when nothing answers within a second.
pub async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
            .await
            .ok()?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.ok()?;
        let response = String::from_utf8_lossy(&response);
        let status = response.get(9..12)?.parse().ok()?;
        let body = response.split_once("\r\n\r\n").map_or("", |(_, body)| body);
        Some((status, body.to_owned()))
    };
    tokio::time::timeout(Duration::from_secs(1), exchange)
        .await
        .ok()
        .flatten()
}

/// Waits until `ok` holds, polling every 100 ms, for at most `patience`; panics naming
/// `what` (with `log` for the reason) otherwise.
pub async fn wait_until<F, Fut>(what: &str, patience: Duration, log: impl Fn() -> String, ok: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + patience;
    while !ok().await {
        assert!(
            Instant::now() < deadline,
            "{what}: not within {patience:?}\n{}",
            log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The last `lines` lines of the file at `path`, for failure messages.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Whether `program` is on PATH.
pub fn on_path(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()
        .is_ok_and(|output| output.status.success())
}
