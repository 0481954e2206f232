//! A chain of iptables rules of the test's own, hooked into `OUTPUT` (loopback packets pass it
//! once, on the way out), that drops packets: a network partition inside one machine. Packets
//! are dropped, not refused, so connections hang as on a real partition and each side only
//! notices through its own timeouts. Removed on [`Chain::heal`] or drop, also when the test
//! panicked. (`tc netem` would be the usual tool, but this kernel has no `sch_netem`.)
#![allow(dead_code)]

use std::process::{Command, Stdio};

/// A chain in force until [`heal`](Self::heal) or drop.
pub struct Chain {
    name: String,
    healed: bool,
}

impl Chain {
    /// True when `iptables` can be run here (it needs root and the binary).
    pub fn available() -> bool {
        iptables(&["-w", "-L", "OUTPUT", "-n"]).is_ok()
    }

    /// A chain named `name` dropping every packet that matches one of `rules` (each the
    /// match arguments of one rule, e.g. `["-p", "tcp", "--dport", "5432"]`), in force at
    /// once. A chain of that name left by a run killed before its drop is replaced.
    pub fn drop_matching(name: &str, rules: &[Vec<String>]) -> Self {
        let chain = Self {
            name: name.to_owned(),
            healed: false,
        };
        chain.remove();
        run(&["-w", "-N", name]);
        for rule in rules {
            let mut args = vec!["-w", "-A", name];
            args.extend(rule.iter().map(String::as_str));
            args.extend(["-j", "DROP"]);
            run(&args);
        }
        run(&["-w", "-I", "OUTPUT", "-j", name]);
        chain
    }

    /// Rules dropping every TCP packet to or from each of `ports`, both ways.
    pub fn ports_rules(ports: &[u16]) -> Vec<Vec<String>> {
        ports
            .iter()
            .flat_map(|port| {
                ["--dport", "--sport"].map(|side| {
                    ["-p", "tcp", side, &port.to_string()]
                        .map(str::to_owned)
                        .to_vec()
                })
            })
            .collect()
    }

    /// Lets the packets through again.
    pub fn heal(mut self) {
        self.remove();
        self.healed = true;
    }

    fn remove(&self) {
        // Each may fail when there is nothing to remove; that is the point of calling it.
        let _ = iptables(&["-w", "-D", "OUTPUT", "-j", &self.name]);
        let _ = iptables(&["-w", "-F", &self.name]);
        let _ = iptables(&["-w", "-X", &self.name]);
    }
}

impl Drop for Chain {
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
