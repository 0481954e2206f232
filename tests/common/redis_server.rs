//! A `redis-server` of the test's own, on a port of its own, killed (and its data dir removed)
//! on drop: for tests that must stop a server, start it with a setting the shared one must not
//! have, or put a cluster node behind a proxy. The shared server is never reconfigured.
//!
//! A test binary that uses it also has `mod conformance;` (for `require_all`).
#![allow(dead_code)]

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// How long a server may take to answer, or a one-node cluster to come up.
const PATIENCE: Duration = Duration::from_secs(10);

pub struct PrivateServer {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl PrivateServer {
    /// Starts `redis-server` on `port` (no persistence, its own temp dir) with `args` added.
    /// `None` when it cannot be started, a skip unless `TEST_REQUIRE_ALL_BACKENDS=1`.
    pub fn start(port: u16, args: &[&str]) -> Option<Self> {
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-redis-{port}-{:016x}",
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).expect("create the server's temp dir");
        let spawned = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .args(args)
            .stdout(Stdio::null())
            .spawn();
        match spawned {
            Ok(child) => Some(Self { child, port, dir }),
            Err(error) => {
                let _ = std::fs::remove_dir_all(&dir);
                assert!(
                    !crate::conformance::require_all(),
                    "redis-server cannot be started ({error}) but TEST_REQUIRE_ALL_BACKENDS=1"
                );
                eprintln!("skipped: redis-server cannot be started: {error}");
                None
            }
        }
    }

    /// [`start`](Self::start), and waits until it answers `PING`.
    pub async fn start_up(port: u16, args: &[&str]) -> Option<Self> {
        let server = Self::start(port, args)?;
        server.wait_up().await;
        Some(server)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A plain connection to it.
    pub async fn connect(&self) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
        redis::Client::open(self.url())?
            .get_multiplexed_async_connection()
            .await
    }

    /// Waits until the server answers `PING`; panics after a while.
    pub async fn wait_up(&self) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Ok(mut connection) = self.connect().await {
                let pong: redis::RedisResult<String> =
                    redis::cmd("PING").query_async(&mut connection).await;
                if pong.is_ok() {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on {} did not answer within {PATIENCE:?}",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A Redis Cluster of one node on `port` (with `args` added), master of every slot, that
    /// tells clients (in its slot map) to reach it on `announce_port`: the port of a proxy in
    /// front of it, so that every connection of a cluster client crosses that proxy, or
    /// `port` itself.
    pub async fn one_node_cluster(port: u16, announce_port: u16, args: &[&str]) -> Option<Self> {
        let announce = announce_port.to_string();
        let mut all_args = vec![
            "--cluster-enabled",
            "yes",
            "--cluster-announce-ip",
            "127.0.0.1",
            "--cluster-announce-port",
            &announce,
        ];
        all_args.extend_from_slice(args);
        let server = Self::start_up(port, &all_args).await?;
        let mut node = server.connect().await.expect("connect to the node");
        let () = redis::cmd("CLUSTER")
            .arg("ADDSLOTSRANGE")
            .arg(0)
            .arg(16383)
            .query_async(&mut node)
            .await
            .expect("CLUSTER ADDSLOTSRANGE");
        let deadline = Instant::now() + PATIENCE;
        loop {
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query_async(&mut node)
                .await
                .expect("CLUSTER INFO");
            if info.contains("cluster_state:ok") {
                return Some(server);
            }
            assert!(
                Instant::now() < deadline,
                "the one-node cluster did not come up within {PATIENCE:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind an ephemeral port")
        .local_addr()
        .expect("its address")
        .port()
}
