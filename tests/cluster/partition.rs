//! A network partition inside one machine's loopback: one cluster node cut off from its
//! peers (cluster bus) and from its replica (replication link), while clients still reach it.
//! That is the split Redis's asynchronous replication is weakest against: the isolated master
//! keeps acknowledging writes that its replica, promoted on the other side, never receives.
//!
//! Done with iptables rules in a chain of this test's own, hooked into `OUTPUT` (loopback
//! packets pass it once, on the way out). Each node opens its connections from its own
//! source address (see [`super::source_addr`]), so the rules can tell the isolated node's
//! links from every other node's; clients connect from 127.0.0.1 and are not matched. The
//! packets are dropped, not refused: connections hang as on a real partition, and Redis
//! notices only through its node timeout. `tc netem` would be the usual tool, but this
//! machine's kernel has no `sch_netem`.
#![allow(dead_code)]

use std::process::{Command, Stdio};

use super::{bus_port, source_addr};

/// A partition in force until [`heal`](Self::heal) or drop.
pub struct Partition {
    chain: String,
    healed: bool,
}

impl Partition {
    /// True when `iptables` can be run here (it needs root and the binary).
    pub fn available() -> bool {
        iptables(&["-w", "-L", "OUTPUT", "-n"]).is_ok()
    }

    /// Cuts the node on `victim` from every node in `ports` (cluster bus, both ways) and from
    /// its replica `replica`'s replication link; clients still reach `victim`.
    pub fn isolate(victim: u16, replica: u16, ports: &[u16]) -> Self {
        let chain = format!("TI-PART-{victim}");
        let partition = Self {
            chain: chain.clone(),
            healed: false,
        };
        // A chain left by a run that was killed before its drop: start from nothing.
        partition.remove();
        run(&["-w", "-N", &chain]);
        let buses = ports
            .iter()
            .map(|&p| bus_port(p).to_string())
            .collect::<Vec<_>>()
            .join(",");
        let victim_src = source_addr(victim);
        let replica_src = source_addr(replica);
        let victim_bus = bus_port(victim).to_string();
        let victim_port = victim.to_string();
        let rules: [&[&str]; 6] = [
            // The victim's own bus links to its peers, and their answers.
            &[
                "-s",
                &victim_src,
                "-p",
                "tcp",
                "-m",
                "multiport",
                "--dports",
                &buses,
            ],
            &[
                "-d",
                &victim_src,
                "-p",
                "tcp",
                "-m",
                "multiport",
                "--sports",
                &buses,
            ],
            // The peers' bus links to the victim, and its answers.
            &["-p", "tcp", "--dport", &victim_bus],
            &["-p", "tcp", "--sport", &victim_bus],
            // The replica's replication link to the victim, both ways.
            &["-s", &replica_src, "-p", "tcp", "--dport", &victim_port],
            &["-d", &replica_src, "-p", "tcp", "--sport", &victim_port],
        ];
        for rule in rules {
            let mut args = vec!["-w", "-A", chain.as_str()];
            args.extend_from_slice(rule);
            args.extend_from_slice(&["-j", "DROP"]);
            run(&args);
        }
        run(&["-w", "-I", "OUTPUT", "-j", &chain]);
        partition
    }

    /// Lets the victim's links through again.
    pub fn heal(mut self) {
        self.remove();
        self.healed = true;
    }

    fn remove(&self) {
        // Each may fail when there is nothing to remove; that is the point of calling it.
        let _ = iptables(&["-w", "-D", "OUTPUT", "-j", &self.chain]);
        let _ = iptables(&["-w", "-F", &self.chain]);
        let _ = iptables(&["-w", "-X", &self.chain]);
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        if !self.healed {
            self.remove();
        }
    }
}

fn iptables(args: &[&str]) -> Result<(), String> {
    let output = Command::new("iptables")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|error| format!("iptables cannot be run: {error}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).into_owned())
    }
}

fn run(args: &[&str]) {
    if let Err(error) = iptables(args) {
        panic!("iptables {}: {error}", args.join(" "));
    }
}
