//! The `payments` example started inside an [`Isolated`] network namespace: it binds on the
//! namespace's HTTP link, and its `DATABASE_URL` / `REDIS_URL` point at the proxies that carry
//! its store traffic over the store link (which the test can partition or slow down).

#[path = "../common/netns.rs"]
mod isolated;
pub use isolated::Isolated;

use crate::process::{shared::require_all, Launch, Server};

/// A fresh [`Isolated`] host, or `None` (skip, with a note) when this machine cannot make one,
/// unless `TEST_REQUIRE_ALL_BACKENDS=1`, which makes that a failure.
pub fn isolated_or_skip() -> Option<Isolated> {
    match Isolated::new() {
        Ok(isolated) => Some(isolated),
        Err(error) if require_all() => {
            panic!("network namespaces unavailable but TEST_REQUIRE_ALL_BACKENDS=1: {error}")
        }
        Err(error) => {
            eprintln!("skipped: network namespaces unavailable: {error}");
            None
        }
    }
}

/// The variables whose URLs name a store server to reach through the namespace's proxies.
const STORE_VARS: &[&str] = &["DATABASE_URL", "REDIS_URL"];

/// Starts `launch` inside `isolated`; `env` is the example's store environment as the root
/// namespace sees it (e.g. `Shared::env()`), rewritten here to the proxies' addresses.
pub async fn start_isolated(
    isolated: &mut Isolated,
    launch: Launch,
    env: &[(String, String)],
) -> Server {
    let mut rewritten = Vec::with_capacity(env.len());
    for (name, value) in env {
        let value = if STORE_VARS.contains(&name.as_str()) {
            through(isolated, value).await
        } else {
            value.clone()
        };
        rewritten.push((name.clone(), value));
    }
    launch
        .envs(&rewritten)
        .env("BIND", format!("{}:0", isolated.http_addr))
        .prefix(isolated.exec_prefix())
        .start()
        .await
}

/// `url` with its loopback `host:port` replaced by the proxy for that port; a URL without a
/// loopback server (a SQLite file) is returned as it is, as the namespace shares the files.
async fn through(isolated: &mut Isolated, url: &str) -> String {
    let Some(authority_start) = url.find("://").map(|i| i + 3) else {
        return url.to_owned();
    };
    let rest = &url[authority_start..];
    let authority_end = rest
        .find(['/', '?'])
        .map_or(url.len(), |i| authority_start + i);
    let authority = &url[authority_start..authority_end];
    let host_start = authority.rfind('@').map_or(0, |i| i + 1);
    let (host, port) = match authority[host_start..].rsplit_once(':') {
        Some((host, port)) => (host, port.parse().ok()),
        None => (&authority[host_start..], None),
    };
    if !matches!(host, "127.0.0.1" | "localhost") {
        return url.to_owned();
    }
    let scheme = &url[..authority_start - 3];
    let Some(port) = port.or_else(|| default_port(scheme)) else {
        return url.to_owned();
    };
    let proxy = isolated.forward(port).await;
    format!(
        "{}{}{proxy}{}",
        &url[..authority_start],
        &authority[..host_start],
        &url[authority_end..]
    )
}

fn default_port(scheme: &str) -> Option<u16> {
    match scheme {
        "postgres" | "postgresql" => Some(5432),
        "mysql" | "mariadb" => Some(3306),
        "redis" => Some(6379),
        _ => None,
    }
}
