//! A two-node PostgreSQL cluster with automatic failover, owned by one test: Patroni (one
//! process per node, each starting and watching its own PostgreSQL) with a one-member etcd for
//! the leader lock, and HAProxy in front, sending clients to whichever node Patroni's REST
//! API calls the primary (`GET /primary` answers 200 only there).
//!
//! Why Patroni rather than pg_auto_failover: it starts faster and more predictably on a small
//! machine (etcd is up in well under a second; pg_auto_failover needs a third PostgreSQL, the
//! monitor, and takes several keeper rounds per state change), its failover time is set by
//! one number (the leader lock's `ttl`, here 5 s), and `synchronous_mode` promotes only the
//! standby that acknowledged every commit. sqlx has no multi-host URL, so a proxy is needed in
//! front either way, and HAProxy with a health check on Patroni's REST API is the usual one.
//!
//! Ports, from `base`: etcd's client ports for node 0 and node 1 (two listeners of one etcd,
//! so a partition can cut one node's lock traffic alone), etcd's peer port, HAProxy, the two
//! PostgreSQL ports, the two REST ports. Patroni talks to its own PostgreSQL over a Unix
//! socket, so a partition of a node's ports cuts it from the others and keeps it whole.

use std::{
    path::PathBuf,
    process::{Child, Command},
    time::Duration,
};

use sqlx::{Connection, PgConnection};

use super::{
    http_get, http_status, iptables::Chain, kill_9, kill_child, on_path, tail, wait_until, OwnDir,
    User,
};

/// How long the cluster may take to form, or to fail over, before the test fails.
const PATIENCE: Duration = Duration::from_secs(60);
const BIN_DIR: &str = "/usr/lib/postgresql/15/bin";

/// How commits reach the standby.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// The primary acknowledges a commit once it is in its own WAL; the standby follows.
    Async,
    /// Patroni's `synchronous_mode`: the standby is named in `synchronous_standby_names`, so
    /// with `synchronous_commit = on` the primary acknowledges a commit only once the standby
    /// has flushed it, and only that standby may be promoted.
    Sync,
}

impl Replication {
    pub fn name(self) -> &'static str {
        match self {
            Self::Async => "async",
            Self::Sync => "sync",
        }
    }
}

struct Node {
    pg_port: u16,
    rest_port: u16,
    etcd_port: u16,
    dir: PathBuf,
    config: PathBuf,
    log: PathBuf,
    patroni: Option<Child>,
}

impl Node {
    fn postmaster_pid(&self) -> Option<u32> {
        let text = std::fs::read_to_string(self.dir.join("data/postmaster.pid")).ok()?;
        text.lines().next()?.trim().parse().ok()
    }
}

/// The cluster; see the module docs.
pub struct PgCluster {
    pub replication: Replication,
    base: u16,
    user: User,
    etcd: Option<Child>,
    haproxy: Option<Child>,
    nodes: Vec<Node>,
    partition: Option<Chain>,
    // Last, so the processes are gone before their files.
    dir: OwnDir,
}

impl PgCluster {
    /// Starts etcd, node 0 (which bootstraps and becomes the primary), node 1 (a standby made
    /// by `pg_basebackup`) and HAProxy, and waits until the standby streams (with
    /// [`Replication::Sync`]: until Patroni made it the synchronous standby). `None` (a skip)
    /// when Patroni, etcd or HAProxy is missing, unless `TEST_REQUIRE_ALL_BACKENDS=1`.
    pub async fn start(replication: Replication, base: u16) -> Option<Self> {
        let missing: Vec<&str> = ["patroni", "etcd", "haproxy"]
            .into_iter()
            .filter(|tool| !on_path(tool))
            .collect();
        let user = User::named("postgres");
        if !missing.is_empty() || user.is_none() {
            assert!(
                !crate::process::shared::require_all(),
                "{missing:?} not installed (or no postgres user) but TEST_REQUIRE_ALL_BACKENDS=1: \
                 scripts/services.sh installs them"
            );
            eprintln!("skipped: {missing:?} not installed (scripts/services.sh installs them)");
            return None;
        }
        let user = user.expect("checked");
        let dir = OwnDir::new(&format!("patroni-{base}"), &user);
        let mut cluster = Self {
            replication,
            base,
            user,
            etcd: None,
            haproxy: None,
            nodes: Vec::new(),
            partition: None,
            dir,
        };
        cluster.start_etcd();
        cluster.wait_for_etcd().await;
        for index in 0..2 {
            let node = cluster.node(index);
            cluster.nodes.push(node);
        }
        cluster.start_patroni(0);
        cluster.wait_for_role(0, "/primary").await;
        cluster.start_patroni(1);
        let standby = match replication {
            Replication::Async => "/replica",
            Replication::Sync => "/sync",
        };
        cluster.wait_for_role(1, standby).await;
        cluster.start_haproxy();
        // Past the standby's first two failed checks.
        tokio::time::sleep(Duration::from_millis(800)).await;
        cluster.wait_writable().await;
        Some(cluster)
    }

    /// Where clients connect: HAProxy, which forwards to the primary of the moment.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.base + 3)
    }

    /// The node that is primary now, by Patroni's REST API.
    pub async fn primary(&self) -> Option<usize> {
        for (index, node) in self.nodes.iter().enumerate() {
            if node.patroni.is_some() && http_status(node.rest_port, "/primary").await == Some(200)
            {
                return Some(index);
            }
        }
        None
    }

    /// SIGKILL of node `index` whole: its Patroni (so nothing restarts its PostgreSQL), then
    /// its postmaster.
    pub fn kill(&mut self, index: usize) {
        let node = &mut self.nodes[index];
        let postmaster = node.postmaster_pid();
        if let Some(mut patroni) = node.patroni.take() {
            kill_child(&mut patroni);
        }
        if let Some(pid) = postmaster {
            kill_9(pid);
        }
    }

    /// Cuts node `index` from its peer, its lock in etcd and the clients (HAProxy): every
    /// packet to or from its PostgreSQL, REST and etcd client ports is dropped. Its Patroni
    /// loses the lock and demotes it; the other node takes the lock and is promoted.
    pub fn partition(&mut self, index: usize) {
        let node = &self.nodes[index];
        self.partition = Some(Chain::drop_matching(
            &format!("TI-PG-{}", self.base),
            &Chain::ports_rules(&[node.pg_port, node.rest_port, node.etcd_port]),
        ));
    }

    /// Ends a [`partition`](Self::partition).
    pub fn heal(&mut self) {
        if let Some(chain) = self.partition.take() {
            chain.heal();
        }
    }

    /// Waits until node `index` is the primary and a client through HAProxy can write.
    pub async fn wait_promoted(&self, index: usize) {
        self.wait_for_role(index, "/primary").await;
        self.wait_writable().await;
    }

    /// Waits until new connections through HAProxy land on a writable server, four in a
    /// row: HAProxy starts with every server up and marks the standby down only after two
    /// failed checks, and balances round-robin until then.
    async fn wait_writable(&self) {
        let url = self.url();
        wait_until(
            "a writable primary behind HAProxy",
            PATIENCE,
            || self.logs(),
            || async {
                for _ in 0..4 {
                    let Ok(mut conn) = PgConnection::connect(&url).await else {
                        return false;
                    };
                    let standby: Result<bool, _> = sqlx::query_scalar("SELECT pg_is_in_recovery()")
                        .fetch_one(&mut conn)
                        .await;
                    let _ = conn.close().await;
                    if !standby.is_ok_and(|standby| !standby) {
                        return false;
                    }
                }
                true
            },
        )
        .await;
    }

    /// Until etcd has decided its cluster version: a Patroni that connects before then
    /// exits at once (its etcd3 client parses the version "not_decided" as a number), and the
    /// node never comes up (seen on a loaded machine).
    async fn wait_for_etcd(&self) {
        let port = self.base;
        let log = self.dir.path.join("etcd.log");
        wait_until(
            "etcd deciding its cluster version",
            PATIENCE,
            || tail(&log, 30),
            || async move {
                http_get(port, "/version")
                    .await
                    .is_some_and(|(status, body)| {
                        status == 200
                            && body.contains("etcdcluster")
                            && !body.contains("not_decided")
                    })
            },
        )
        .await;
    }

    async fn wait_for_role(&self, index: usize, path: &str) {
        let port = self.nodes[index].rest_port;
        wait_until(
            &format!("node {index} answering 200 to {path}"),
            PATIENCE,
            || self.logs(),
            || async move { http_status(port, path).await == Some(200) },
        )
        .await;
    }

    fn logs(&self) -> String {
        self.nodes
            .iter()
            .enumerate()
            .map(|(i, node)| format!("--- node {i}:\n{}", tail(&node.log, 30)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn node(&self, index: u16) -> Node {
        let dir = self.dir.sub(&format!("node{index}"), &self.user);
        Node {
            pg_port: self.base + 4 + index,
            rest_port: self.base + 6 + index,
            etcd_port: self.base + index,
            config: dir.join("patroni.yml"),
            log: dir.join("patroni.log"),
            dir,
            patroni: None,
        }
    }

    fn start_etcd(&mut self) {
        let peer = format!("http://127.0.0.1:{}", self.base + 2);
        let clients = format!(
            "http://127.0.0.1:{},http://127.0.0.1:{}",
            self.base,
            self.base + 1
        );
        let mut command = Command::new("etcd");
        command
            .args(["--name", "etcd"])
            .arg("--data-dir")
            .arg(self.dir.path.join("etcd"))
            .args(["--listen-client-urls", &clients])
            .args([
                "--advertise-client-urls",
                &format!("http://127.0.0.1:{}", self.base),
            ])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("etcd={peer}")]);
        let log = self.dir.path.join("etcd.log");
        self.etcd = Some(self.user.spawn(command, &log).expect("start etcd"));
    }

    fn start_patroni(&mut self, index: usize) {
        let config = self.patroni_config(index);
        let node = &self.nodes[index];
        std::fs::write(&node.config, config).expect("write patroni.yml");
        self.user.own(&node.config);
        let mut command = Command::new("patroni");
        command.arg(&node.config);
        let child = self.user.spawn(command, &node.log).expect("start patroni");
        self.nodes[index].patroni = Some(child);
    }

    /// Patroni's configuration of node `index`. Failover within ~5 s: the leader lock lives
    /// `ttl` seconds unless renewed, Patroni loops every `loop_wait` and gives up a DCS call
    /// after `retry_timeout` (Patroni's rule: `loop_wait + 2 * retry_timeout <= ttl`).
    fn patroni_config(&self, index: usize) -> String {
        let node = &self.nodes[index];
        let sync = self.replication == Replication::Sync;
        format!(
            "scope: ti-{base}
name: node{index}
log: {{level: WARNING}}
restapi: {{listen: '127.0.0.1:{rest}', connect_address: '127.0.0.1:{rest}'}}
etcd3: {{hosts: '127.0.0.1:{etcd}', use_proxies: true}}
bootstrap:
  dcs:
    ttl: 5
    loop_wait: 1
    retry_timeout: 2
    synchronous_mode: {sync}
    postgresql:
      parameters: {{wal_level: replica, hot_standby: 'on', max_wal_senders: 5, max_replication_slots: 5, synchronous_commit: 'on'}}
  initdb: [{{encoding: UTF8}}, {{auth: trust}}]
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication all 127.0.0.1/32 trust
postgresql:
  listen: '127.0.0.1:{pg}'
  connect_address: '127.0.0.1:{pg}'
  data_dir: '{dir}/data'
  bin_dir: '{BIN_DIR}'
  pgpass: '{dir}/pgpass'
  use_unix_socket: true
  parameters: {{unix_socket_directories: '{dir}', max_connections: 100}}
  authentication:
    superuser: {{username: postgres}}
    replication: {{username: postgres}}
",
            base = self.base,
            rest = node.rest_port,
            etcd = node.etcd_port,
            pg = node.pg_port,
            dir = node.dir.display(),
        )
    }

    /// HAProxy: TCP to the node whose `GET /primary` answers 200, checked every 200 ms;
    /// sessions to a node marked down are shut, so no client keeps talking to a former
    /// primary.
    fn start_haproxy(&mut self) {
        let servers: String = self
            .nodes
            .iter()
            .enumerate()
            .map(|(i, node)| {
                format!(
                    "  server node{i} 127.0.0.1:{} check port {}\n",
                    node.pg_port, node.rest_port
                )
            })
            .collect();
        let config = format!(
            "global
  maxconn 400
defaults
  mode tcp
  timeout connect 1s
  timeout client 1h
  timeout server 1h
  timeout check 1s
listen postgres
  bind 127.0.0.1:{port}
  option httpchk GET /primary
  http-check expect status 200
  default-server inter 200ms fall 2 rise 1 on-marked-down shutdown-sessions
{servers}",
            port = self.base + 3
        );
        let path = self.dir.path.join("haproxy.cfg");
        std::fs::write(&path, config).expect("write haproxy.cfg");
        let mut command = Command::new("haproxy");
        command.arg("-db").arg("-f").arg(&path);
        let log = self.dir.path.join("haproxy.log");
        self.haproxy = Some(self.user.spawn(command, &log).expect("start haproxy"));
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        self.heal();
        for index in 0..self.nodes.len() {
            self.kill(index);
        }
        for child in [self.haproxy.as_mut(), self.etcd.as_mut()]
            .into_iter()
            .flatten()
        {
            kill_child(child);
        }
    }
}
