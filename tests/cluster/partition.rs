//! A network partition inside one machine's loopback: one cluster node cut off from its
//! peers (cluster bus) and from its replica (replication link), while clients still reach it.
//! That is the split Redis's asynchronous replication is weakest against: the isolated master
//! keeps acknowledging writes that its replica, promoted on the other side, never receives.
//!
//! Done with a chain of iptables rules of this test's own (`tests/common/iptables.rs`: packets
//! dropped, not refused, so Redis notices only through its node timeout). Each node opens its
//! connections from its own source address (see [`super::source_addr`]), so the rules can
//! tell the isolated node's links from every other node's; clients connect from 127.0.0.1
//! and are not matched.
#![allow(dead_code)]

#[path = "../common/iptables.rs"]
mod iptables;

use iptables::Chain;

use super::{bus_port, source_addr};

/// A partition in force until [`heal`](Self::heal) or drop.
pub struct Partition {
    chain: Chain,
}

impl Partition {
    /// True when `iptables` can be run here (it needs root and the binary).
    pub fn available() -> bool {
        Chain::available()
    }

    /// Cuts the node on `victim` from every node in `ports` (cluster bus, both ways) and from
    /// its replica `replica`'s replication link; clients still reach `victim`.
    pub fn isolate(victim: u16, replica: u16, ports: &[u16]) -> Self {
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
        let rules: Vec<Vec<String>> = rules
            .iter()
            .map(|rule| rule.iter().map(|arg| (*arg).to_owned()).collect())
            .collect();
        Self {
            chain: Chain::drop_matching(&format!("TI-PART-{victim}"), &rules),
        }
    }

    /// Lets the victim's links through again.
    pub fn heal(self) {
        self.chain.heal();
    }
}
