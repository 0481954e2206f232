//! A throw-away Redis Cluster owned by one test: six `redis-server` processes in cluster
//! mode (3 masters, 3 replicas) on fixed loopback ports, data in a temp dir. Dropping it kills
//! every node and removes the dir, also when the test panicked.
#![allow(dead_code)]

pub mod failover;
pub mod partition;

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use redis::{aio::MultiplexedConnection, Value};

/// How long the cluster may take to form, or to fail over.
const PATIENCE: Duration = Duration::from_secs(30);

pub struct Cluster {
    dir: PathBuf,
    nodes: Vec<(u16, Option<Child>)>,
}

impl Cluster {
    /// Starts six nodes on `base_port..base_port + 6` and creates the cluster. `None` (a
    /// skip) when `redis-server` is not on PATH, unless `TEST_REQUIRE_ALL_BACKENDS=1`.
    ///
    /// A short node timeout makes the failover quick; `cluster-require-full-coverage no`
    /// lets the surviving masters serve their slots while a shard has no master.
    pub async fn start(base_port: u16) -> Option<Self> {
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-cluster-{base_port}-{:016x}",
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).expect("create the cluster's temp dir");
        let mut cluster = Self {
            dir,
            nodes: Vec::new(),
        };
        for port in base_port..base_port + 6 {
            match cluster.spawn(port) {
                Ok(child) => cluster.nodes.push((port, Some(child))),
                Err(error) => {
                    assert!(
                        !crate::conformance::require_all(),
                        "redis-server cannot be started ({error}) but TEST_REQUIRE_ALL_BACKENDS=1"
                    );
                    eprintln!("skipped: redis-server cannot be started: {error}");
                    return None;
                }
            }
        }
        for port in cluster.ports() {
            cluster.wait_until(port, "answers PING", |_| true).await;
        }
        // `redis-cli --cluster create` waits for the nodes to join without a limit of its own.
        let created = Command::new("timeout")
            .arg(PATIENCE.as_secs().to_string())
            .arg("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(cluster.ports().map(|port| format!("127.0.0.1:{port}")))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdout(Stdio::null())
            .status()
            .expect("run redis-cli --cluster create");
        assert!(
            created.success(),
            "redis-cli --cluster create failed, or the nodes did not join within {PATIENCE:?}"
        );
        for port in cluster.ports() {
            cluster
                .wait_until(port, "cluster_state:ok", |info| {
                    info.contains("cluster_state:ok")
                })
                .await;
        }
        // Every master has a replica that finished its first sync: WAIT needs it, and a
        // replica that never synced refuses to fail over (its data counts as too old).
        for port in cluster.ports() {
            cluster
                .wait_until_info(port, "replication", "in sync", |info| {
                    let master = info.contains("role:master")
                        && info.contains("connected_slaves:1")
                        && info.contains("state=online");
                    master || info.contains("master_link_status:up")
                })
                .await;
        }
        Some(cluster)
    }

    /// One node in its own dir, where its `nodes.conf` survives a restart: a restarted node
    /// rejoins the cluster it was in.
    fn spawn(&self, port: u16) -> std::io::Result<Child> {
        let node_dir = self.dir.join(port.to_string());
        std::fs::create_dir_all(&node_dir)?;
        Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            // Its own source address for the connections it opens (cluster bus, replication),
            // so a partition can cut one node's links to its peers without the clients'.
            .args(["--bind-source-addr", &source_addr(port)])
            // Peers would otherwise take the node's address from the source of its links.
            .args(["--cluster-announce-ip", "127.0.0.1"])
            // Protected mode admits only 127.0.0.1 itself, not the other nodes' sources; the
            // node listens on loopback alone either way.
            .args(["--protected-mode", "no"])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
            .args(["--cluster-require-full-coverage", "no"])
            .arg("--dir")
            .arg(&node_dir)
            .stdout(Stdio::null())
            .spawn()
    }

    /// Starts a killed node again; it rejoins as a replica of the master that replaced it.
    pub fn restart(&mut self, port: u16) {
        let child = self.spawn(port).expect("restart redis-server");
        let (_, slot) = self
            .nodes
            .iter_mut()
            .find(|(p, _)| *p == port)
            .expect("a node of this cluster");
        assert!(slot.is_none(), "node {port} is running");
        *slot = Some(child);
    }

    pub fn ports(&self) -> impl Iterator<Item = u16> + '_ {
        self.nodes.iter().map(|(port, _)| *port)
    }

    pub fn urls(&self) -> Vec<String> {
        self.ports()
            .map(|port| format!("redis://127.0.0.1:{port}"))
            .collect()
    }

    /// The ports of the nodes that are masters now.
    pub async fn masters(&self) -> Vec<u16> {
        let mut masters = Vec::new();
        for (port, child) in &self.nodes {
            if child.is_some() && role(*port).await.as_deref() == Some("master") {
                masters.push(*port);
            }
        }
        masters
    }

    /// The port of `master`'s replica.
    pub async fn replica_of(&self, master: u16) -> u16 {
        for port in self.ports() {
            let Ok(mut node) = connect(port).await else {
                continue;
            };
            let role: Vec<Value> = redis::cmd("ROLE").query_async(&mut node).await.unwrap();
            if let [Value::BulkString(kind), _, Value::Int(master_port), ..] = &role[..] {
                if kind == b"slave" && *master_port == i64::from(master) {
                    return port;
                }
            }
        }
        panic!("master {master} has no replica");
    }

    /// The slot ranges `master` serves.
    pub async fn slots_of(&self, master: u16) -> Vec<(u16, u16)> {
        let mut node = connect(master).await.expect("connect to the master");
        let slots: Vec<Vec<Value>> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut node)
            .await
            .unwrap();
        slots
            .into_iter()
            .filter_map(|range| {
                let [Value::Int(start), Value::Int(end), Value::Array(owner), ..] = &range[..]
                else {
                    return None;
                };
                let owner_port = match owner.get(1) {
                    Some(Value::Int(port)) => *port,
                    _ => return None,
                };
                (owner_port == i64::from(master)).then_some((*start as u16, *end as u16))
            })
            .collect()
    }

    /// SIGKILL: the node dies on the spot, whatever it was doing.
    pub fn kill(&mut self, port: u16) {
        let (_, child) = self
            .nodes
            .iter_mut()
            .find(|(p, _)| *p == port)
            .expect("a node of this cluster");
        let mut child = child.take().expect("the node is running");
        child.kill().expect("SIGKILL");
        child.wait().expect("wait");
    }

    async fn wait_until(&self, port: u16, what: &str, ok: impl Fn(&str) -> bool) {
        self.wait_until_info(port, "cluster", what, ok).await
    }

    async fn wait_until_info(
        &self,
        port: u16,
        section: &str,
        what: &str,
        ok: impl Fn(&str) -> bool,
    ) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Ok(mut node) = connect(port).await {
                let command = if section == "cluster" {
                    redis::cmd("CLUSTER").arg("INFO").clone()
                } else {
                    redis::cmd("INFO").arg(section).clone()
                };
                let info: redis::RedisResult<String> = command.query_async(&mut node).await;
                if info.is_ok_and(|info| ok(&info)) {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "node {port}: not {what} within {PATIENCE:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, child) in &mut self.nodes {
            if let Some(mut child) = child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The address the node on `port` opens its own connections from: one per node in
/// 127.0.1.0/24 (all of 127/8 is local on Linux). Ports of one cluster are consecutive, so
/// they never share one.
pub fn source_addr(port: u16) -> String {
    format!("127.0.1.{}", port % 256)
}

/// The cluster bus port of the node on `port` (Redis's default offset).
pub fn bus_port(port: u16) -> u16 {
    port + 10000
}

/// A plain (non-cluster) connection to one node.
pub async fn connect(port: u16) -> redis::RedisResult<MultiplexedConnection> {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))?
        .get_multiplexed_async_connection()
        .await
}

/// `master` or `slave`, or `None` when the node does not answer.
pub async fn role(port: u16) -> Option<String> {
    let mut node = connect(port).await.ok()?;
    let role: Vec<Value> = redis::cmd("ROLE").query_async(&mut node).await.ok()?;
    match role.first() {
        Some(Value::BulkString(kind)) => Some(String::from_utf8_lossy(kind).into_owned()),
        _ => None,
    }
}

/// The slot of `key`, asked of the node on `port` (`CLUSTER KEYSLOT`).
pub async fn slot_of(port: u16, key: &str) -> u16 {
    let mut node = connect(port).await.expect("connect");
    redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query_async(&mut node)
        .await
        .expect("CLUSTER KEYSLOT")
}

/// True when the node on `port` is a replica whose link to its master is up.
pub async fn in_sync_as_replica(port: u16) -> bool {
    let Ok(mut node) = connect(port).await else {
        return false;
    };
    let info: redis::RedisResult<String> = redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut node)
        .await;
    info.is_ok_and(|info| info.contains("role:slave") && info.contains("master_link_status:up"))
}
