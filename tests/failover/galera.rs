//! A three-node MariaDB Galera cluster owned by one test: node 0 bootstraps a new cluster
//! (`gcomm://`, as `galera_new_cluster` does) on a data dir made by `mariadb-install-db`, the
//! other two join it and receive its state by rsync (SST). Every option is on the command
//! line (`--no-defaults`): own ports from `base` (SQL `base..base+3`, group communication
//! `base+10..`, IST `base+20..`, SST `base+30..`), own data dirs in a temp dir.
//!
//! Galera replicates at commit: a transaction runs on its node alone, and at its commit its
//! write set is certified against the write sets the cluster ordered before it. Two claims of
//! one key on two nodes both succeed locally; the later one fails certification (error 1213,
//! "Deadlock found"), or is aborted by the winner's write set mid-way (a brute-force abort,
//! same error on its next statement).

use std::{
    path::PathBuf,
    process::{Child, Command},
    time::Duration,
};

use sqlx::{Connection, MySqlConnection};

use super::{kill_child, on_path, tail, wait_until, OwnDir, User};

const PATIENCE: Duration = Duration::from_secs(60);
const PROVIDER: &str = "/usr/lib/galera/libgalera_smm.so";

struct Node {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

/// The cluster; see the module docs.
pub struct GaleraCluster {
    base: u16,
    user: User,
    nodes: Vec<Node>,
    dir: OwnDir,
}

impl GaleraCluster {
    /// Starts the three nodes and waits until each is synced (`wsrep_ready = ON`) in a cluster
    /// of three. `None` (a skip) when MariaDB or Galera is missing, unless
    /// `TEST_REQUIRE_ALL_BACKENDS=1`.
    pub async fn start(base: u16) -> Option<Self> {
        let user = User::named("mysql");
        let present = on_path("mariadbd")
            && on_path("mariadb-install-db")
            && on_path("rsync")
            && std::path::Path::new(PROVIDER).exists();
        if !present || user.is_none() {
            assert!(
                !crate::process::shared::require_all(),
                "mariadb-server, galera-4 or rsync missing but TEST_REQUIRE_ALL_BACKENDS=1: \
                 scripts/services.sh installs them"
            );
            eprintln!("skipped: mariadb-server, galera-4 or rsync missing");
            return None;
        }
        let user = user.expect("checked");
        let dir = OwnDir::new(&format!("galera-{base}"), &user);
        let mut cluster = Self {
            base,
            user,
            nodes: Vec::new(),
            dir,
        };
        for index in 0..3u16 {
            let dir = cluster.dir.sub(&format!("node{index}"), &cluster.user);
            cluster.dir.sub(&format!("node{index}/data"), &cluster.user);
            cluster.nodes.push(Node {
                port: base + index,
                dir,
                child: None,
            });
        }
        cluster.install_first();
        cluster.spawn(0, "gcomm://");
        cluster.wait_synced(0).await;
        let peers = (0..3)
            .map(|i| format!("127.0.0.1:{}", base + 10 + i))
            .collect::<Vec<_>>()
            .join(",");
        for index in 1..3 {
            cluster.spawn(index, &format!("gcomm://{peers}"));
        }
        for index in 1..3 {
            cluster.wait_synced(index).await;
        }
        Some(cluster)
    }

    /// The URL of node `index` (its `mysql` database: a test makes its own).
    pub fn url(&self, index: usize) -> String {
        format!("mysql://root@127.0.0.1:{}/mysql", self.nodes[index].port)
    }

    /// Certification failures and brute-force aborts, summed over the nodes (each node counts
    /// its own local transactions).
    pub async fn conflicts(&self) -> (u64, u64) {
        let (mut cert, mut bf) = (0, 0);
        for index in 0..self.nodes.len() {
            let mut conn = MySqlConnection::connect(&self.url(index))
                .await
                .expect("connect to a Galera node");
            let rows: Vec<(String, String)> = sqlx::query_as(
                "SHOW GLOBAL STATUS WHERE Variable_name IN \
                 ('wsrep_local_cert_failures', 'wsrep_local_bf_aborts')",
            )
            .fetch_all(&mut conn)
            .await
            .expect("wsrep status");
            for (name, value) in rows {
                let value: u64 = value.parse().unwrap_or(0);
                if name == "wsrep_local_cert_failures" {
                    cert += value;
                } else {
                    bf += value;
                }
            }
        }
        (cert, bf)
    }

    fn install_first(&self) {
        let node = &self.nodes[0];
        let log = node.dir.join("install.log");
        let mut command = Command::new("mariadb-install-db");
        command
            .arg("--no-defaults")
            .arg(format!("--datadir={}", node.dir.join("data").display()))
            .args(["--auth-root-authentication-method=normal", "--skip-test-db"]);
        let status = self
            .user
            .spawn(command, &log)
            .expect("run mariadb-install-db")
            .wait()
            .expect("wait for mariadb-install-db");
        assert!(status.success(), "mariadb-install-db: {}", tail(&log, 20));
    }

    fn spawn(&mut self, index: usize, cluster_address: &str) {
        let base = self.base;
        let node = &self.nodes[index];
        let i = index as u16;
        let dir = node.dir.display().to_string();
        let mut command = Command::new("mariadbd");
        command
            .arg("--no-defaults")
            .arg(format!("--datadir={dir}/data"))
            .arg(format!("--socket={dir}/mysqld.sock"))
            .arg(format!("--pid-file={dir}/mysqld.pid"))
            .arg(format!("--log-error={dir}/error.log"))
            .arg(format!("--port={}", node.port))
            .args(["--bind-address=127.0.0.1", "--innodb-buffer-pool-size=32M"])
            // What Galera requires of every node.
            .args(["--binlog-format=ROW", "--innodb-autoinc-lock-mode=2"])
            .args(["--wsrep-on=ON", &format!("--wsrep-provider={PROVIDER}")])
            .arg(format!("--wsrep-cluster-name=ti-{base}"))
            .arg(format!("--wsrep-cluster-address={cluster_address}"))
            .arg(format!("--wsrep-node-address=127.0.0.1:{}", base + 10 + i))
            .arg(format!(
                "--wsrep-provider-options=gmcast.listen_addr=tcp://127.0.0.1:{};ist.recv_addr=127.0.0.1:{};gcache.size=16M",
                base + 10 + i,
                base + 20 + i
            ))
            .args(["--wsrep-sst-method=rsync"])
            .arg(format!(
                "--wsrep-sst-receive-address=127.0.0.1:{}",
                base + 30 + i
            ));
        let log = node.dir.join("stdout.log");
        let child = self.user.spawn(command, &log).expect("start mariadbd");
        self.nodes[index].child = Some(child);
    }

    async fn wait_synced(&self, index: usize) {
        let url = self.url(index);
        let log = self.nodes[index].dir.join("error.log");
        wait_until(
            &format!("Galera node {index} synced"),
            PATIENCE,
            || tail(&log, 30),
            || async {
                let Ok(mut conn) = MySqlConnection::connect(&url).await else {
                    return false;
                };
                let ready: Result<(String, String), _> =
                    sqlx::query_as("SHOW STATUS LIKE 'wsrep_ready'")
                        .fetch_one(&mut conn)
                        .await;
                let _ = conn.close().await;
                ready.is_ok_and(|(_, value)| value == "ON")
            },
        )
        .await;
    }
}

impl Drop for GaleraCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(child) = node.child.as_mut() {
                kill_child(child);
            }
        }
    }
}
