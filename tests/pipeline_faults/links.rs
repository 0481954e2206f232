//! What stands between the processes and their infrastructure, so the test can take it away
//! without touching the machine's shared servers: the broker (a TCP proxy of the test's own in
//! front of RabbitMQ or SQS, or a `nats-server -js` of the test's own; Kafka directly) and the
//! consumers' database (a TCP proxy in front of PostgreSQL).

use std::time::Duration;

use tokio::sync::Mutex;

use crate::{nats_server::PrivateNats, proxy::Proxy};

/// The broker as the processes reach it.
pub enum BrokerLink {
    /// RabbitMQ or SQS behind a proxy: an outage cuts every connection and turns new ones
    /// away.
    Proxied { proxy: Proxy, url: String },
    /// The broker itself, which the test cannot take away: a Kafka client reaches the
    /// brokers the cluster advertises, past any proxy in front of the bootstrap address.
    Direct { url: String },
    /// A NATS server of the test's own: an outage is a SIGKILL, a restart on the same port and
    /// store directory after the outage.
    Nats {
        server: Mutex<PrivateNats>,
        url: String,
    },
}

impl BrokerLink {
    /// A proxy in front of the broker at `url` (RabbitMQ, or an SQS endpoint).
    pub async fn proxied(url: &str) -> Self {
        let (host, port) = host_port(url);
        let proxy = Proxy::start(&host, port).await;
        let url = with_authority(url, &proxy.addr().to_string());
        Self::Proxied { proxy, url }
    }

    /// A NATS server of the test's own; `None` (a skip) when none can be started.
    pub fn nats(require_all: bool) -> Option<Self> {
        let server = PrivateNats::start(require_all)?;
        let url = server.url();
        Some(Self::Nats {
            server: Mutex::new(server),
            url,
        })
    }

    /// The URL the processes are given.
    pub fn url(&self) -> &str {
        match self {
            Self::Proxied { url, .. } | Self::Nats { url, .. } | Self::Direct { url } => url,
        }
    }

    /// Takes the broker away for `outage`, then brings it back.
    pub async fn outage(&self, outage: Duration) {
        match self {
            Self::Direct { url } => {
                panic!("no outage of the broker at {url}: it is reached directly")
            }
            Self::Proxied { proxy, .. } => {
                proxy.cut();
                tokio::time::sleep(outage).await;
                proxy.restore();
            }
            Self::Nats { server, .. } => {
                let mut server = server.lock().await;
                server.kill();
                tokio::time::sleep(outage).await;
                server.restart();
            }
        }
    }
}

/// The consumers' way to PostgreSQL: a proxy the test cuts for an outage of the database as
/// the consumers see it (the payments process keeps its own, direct connections).
pub struct DatabaseLink {
    proxy: Proxy,
    /// `DATABASE_URL` for the consumers.
    pub url: String,
}

impl DatabaseLink {
    /// A proxy in front of the server of `url`.
    pub async fn new(url: &str) -> Self {
        let (host, port) = host_port(url);
        let proxy = Proxy::start(&host, port).await;
        let url = with_authority(url, &proxy.addr().to_string());
        Self { proxy, url }
    }

    /// Cuts every connection, turns new ones away for `outage`, then forwards again. Returns
    /// how many connections were turned away meanwhile: proof the consumers tried.
    pub async fn outage(&self, outage: Duration) -> usize {
        let before = self.proxy.turned_away();
        self.proxy.cut();
        tokio::time::sleep(outage).await;
        self.proxy.restore();
        self.proxy.turned_away() - before
    }
}

/// The start and end (exclusive) of the `host:port` of `url`, after any `user:password@`.
fn authority(url: &str) -> (usize, usize) {
    let start = url.find("://").map_or(0, |i| i + 3);
    let end = url[start..]
        .find(['/', '?'])
        .map_or(url.len(), |i| start + i);
    let host = url[start..end].rfind('@').map_or(start, |i| start + i + 1);
    (host, end)
}

/// The host and port of `url` (`amqp://guest:guest@127.0.0.1:5672/%2f` -> `127.0.0.1`, 5672).
fn host_port(url: &str) -> (String, u16) {
    let (start, end) = authority(url);
    let (host, port) = url[start..end]
        .rsplit_once(':')
        .unwrap_or_else(|| panic!("{url} names no port"));
    (host.to_owned(), port.parse().expect("a port number"))
}

/// `url` with its `host:port` replaced by `authority`.
fn with_authority(url: &str, authority: &str) -> String {
    let (start, end) = self::authority(url);
    format!("{}{authority}{}", &url[..start], &url[end..])
}

#[test]
fn authorities_are_replaced() {
    assert_eq!(
        with_authority("amqp://guest:guest@127.0.0.1:5672/%2f", "127.0.0.1:9"),
        "amqp://guest:guest@127.0.0.1:9/%2f"
    );
    assert_eq!(
        with_authority(
            "postgres://root@127.0.0.1:5432/test?options=-csearch_path%3Dx",
            "h:1"
        ),
        "postgres://root@h:1/test?options=-csearch_path%3Dx"
    );
    assert_eq!(
        host_port("nats://127.0.0.1:4222"),
        ("127.0.0.1".into(), 4222)
    );
}
