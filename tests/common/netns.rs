//! An isolated host for one service process: a fresh Linux network namespace joined to the
//! test's namespace by two veth pairs, so that a test can cut a service off from its store
//! while it still reaches the service itself.
//!
//! ```text
//!  root namespace (the test, the stores on 127.0.0.1)      namespace `tin<id>`
//!  client: connects to http_addr ----- veth `tih<id>` ===== `http0`  <- the service binds here
//!  Proxy on store_host:PORT <--------- veth `tis<id>` ===== `store0` <- the service's store traffic
//!      `-> forwards to 127.0.0.1:PORT
//! ```
//!
//! The stores listen only on loopback, so each store port gets a forwarding [`Proxy`] in the
//! root namespace, bound to the store link's host-side address. The faults:
//!
//! - [`Isolated::partition`] takes the host side of the store link down: every packet between
//!   the service and its stores is dropped, with no connection closed on either side (TCP
//!   retransmits until [`Isolated::heal`] brings the link up again). The proxies' own
//!   connections to the stores stay open, as a store's would in a real partition.
//! - [`Isolated::delay`] makes the proxies hold every byte, each way.
//! - Packet loss is not available: this kernel has no `sch_netem` (`tc qdisc ... netem` is
//!   refused) and no module to load. TCP hides loss from the application anyway, as delay and
//!   retransmissions; a partition is loss at its extreme.
//!
//! Everything needs root and `ip` (iproute2). Without them [`Isolated::new`] returns the error
//! (`tests/process/netns.rs` then skips with a note, like a test whose server is absent, unless
//! `TEST_REQUIRE_ALL_BACKENDS=1`). [`Drop`] deletes the links and the namespace, also when the
//! test panics.
#![allow(dead_code)]

use std::{
    collections::HashMap,
    net::{Ipv4Addr, SocketAddr},
    process::{Command, Output},
    time::Duration,
};

// Included by path, so the file works from any test binary's module tree.
#[path = "proxy.rs"]
mod proxy;
use proxy::Proxy;

/// A network namespace with a link for HTTP and one for store traffic; see the module docs.
pub struct Isolated {
    /// The namespace's name, for `ip netns exec`.
    pub namespace: String,
    http_link: String,
    store_link: String,
    /// Inside the namespace: where the service binds.
    pub http_addr: Ipv4Addr,
    /// In the root namespace: where the store proxies listen.
    store_host: Ipv4Addr,
    proxies: HashMap<u16, Proxy>,
}

/// An `ip` command failed; the message names it and its stderr.
#[derive(Debug, thiserror::Error)]
#[error("`ip {args}` failed: {stderr}")]
pub struct IpError {
    args: String,
    stderr: String,
}

impl Isolated {
    /// A fresh namespace with both links up and addressed, or the `ip` command that failed
    /// (not root, no `ip`): the caller skips or fails as its backends rule says.
    pub fn new() -> Result<Self, IpError> {
        // Short and unique: interface names are at most 15 bytes, and tests of several
        // binaries may hold namespaces at once.
        let id = format!("{:06x}", rand::random::<u32>() & 0xff_ffff);
        let subnet = free_subnet()?;
        let [a, b] = [subnet.0, subnet.1];
        let isolated = Isolated {
            namespace: format!("tin{id}"),
            http_link: format!("tih{id}"),
            store_link: format!("tis{id}"),
            http_addr: Ipv4Addr::new(10, a, b, 2),
            store_host: Ipv4Addr::new(10, a, b, 5),
            proxies: HashMap::new(),
        };
        ip(&["netns", "add", &isolated.namespace])?;
        // From here on, Drop cleans up whatever was made.
        let ns = isolated.namespace.clone();
        let setup = [
            (isolated.http_link.clone(), "http0", [1u8, 2u8]),
            (isolated.store_link.clone(), "store0", [5, 6]),
        ];
        let result = (|| {
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            for (host, inside, [host_ip, inside_ip]) in &setup {
                ip(&[
                    "link", "add", host, "type", "veth", "peer", "name", inside, "netns", &ns,
                ])?;
                let host_cidr = format!("10.{a}.{b}.{host_ip}/30");
                let inside_cidr = format!("10.{a}.{b}.{inside_ip}/30");
                ip(&["addr", "add", &host_cidr, "dev", host])?;
                ip(&["link", "set", host, "up"])?;
                ip(&["-n", &ns, "addr", "add", &inside_cidr, "dev", inside])?;
                ip(&["-n", &ns, "link", "set", inside, "up"])?;
            }
            Ok(())
        })();
        // On an error, dropping `isolated` deletes what was made.
        result.map(|()| isolated)
    }

    /// The address in the root namespace, on the store link, where the service reaches the
    /// store on 127.0.0.1:`port` (a proxy is started for it on first use).
    pub async fn forward(&mut self, port: u16) -> SocketAddr {
        if let Some(proxy) = self.proxies.get(&port) {
            return proxy.addr();
        }
        let listen = SocketAddr::from((self.store_host, 0));
        let proxy = Proxy::start_on(listen, "127.0.0.1", port).await;
        let addr = proxy.addr();
        self.proxies.insert(port, proxy);
        addr
    }

    /// Cuts the service off from every store: the store link goes down.
    pub fn partition(&self) {
        ip(&["link", "set", &self.store_link, "down"]).expect("take the store link down");
    }

    /// Ends a [`partition`](Self::partition): the store link comes up again (the kernel puts
    /// the link's route back by itself).
    pub fn heal(&self) {
        ip(&["link", "set", &self.store_link, "up"]).expect("bring the store link up");
    }

    /// Every byte between the service and its stores is held `one_way` in each direction
    /// (`Duration::ZERO`: none), on live and new connections.
    pub fn delay(&self, one_way: Duration) {
        for proxy in self.proxies.values() {
            proxy.delay(one_way);
        }
    }

    /// The prefix that runs a program inside the namespace.
    pub fn exec_prefix(&self) -> Vec<String> {
        ["ip", "netns", "exec", &self.namespace]
            .map(str::to_owned)
            .to_vec()
    }
}

impl Drop for Isolated {
    fn drop(&mut self) {
        // Deleting one end of a veth pair deletes both; the namespace goes last. Errors are
        // ignored: a half-made namespace has less to delete.
        let _ = ip(&["link", "del", &self.http_link]);
        let _ = ip(&["link", "del", &self.store_link]);
        let _ = ip(&["netns", "del", &self.namespace]);
    }
}

/// Two octets `a.b` such that no interface of the root namespace has an address in
/// `10.a.b.0/24` yet (the namespace uses `10.a.b.0/30` and `10.a.b.4/30`).
fn free_subnet() -> Result<(u8, u8), IpError> {
    let taken = String::from_utf8_lossy(&ip(&["-4", "-o", "addr", "show"])?.stdout).into_owned();
    for _ in 0..100 {
        let (a, b) = (rand::random_range(64..=250u8), rand::random::<u8>());
        if !taken.contains(&format!(" 10.{a}.{b}.")) {
            return Ok((a, b));
        }
    }
    Err(IpError {
        args: "-4 -o addr show".to_owned(),
        stderr: "no free 10.x.y.0/24 found".to_owned(),
    })
}

/// Runs `ip ARGS`; a failure (including a missing `ip`) is an [`IpError`].
fn ip(args: &[&str]) -> Result<Output, IpError> {
    let failed = |stderr: String| IpError {
        args: args.join(" "),
        stderr,
    };
    let output = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| failed(e.to_string()))?;
    if output.status.success() {
        Ok(output)
    } else {
        Err(failed(
            String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        ))
    }
}
