//! The check that Redis keeps every record until its own expiry.
//!
//! Every record carries `PX` (a claim its lease, a completed record its retention), so every
//! eviction policy but `noeviction` may drop one under memory pressure: `volatile-*` policies
//! pick among keys with an expiry — all of ours — and `allkeys-*` among all keys. An evicted
//! claim or record is simply gone, and a duplicate arriving then runs the operation again,
//! with nothing in any log. So the store asks each node for its `maxmemory-policy` when it
//! opens.

use std::collections::HashMap;

use redis::{ErrorKind, RedisError, RedisResult, Value};

use super::{backend, connection::Connection};
use crate::store::StoreError;

/// The one policy under which Redis never drops a key before its expiry: when memory is full
/// it refuses writes instead (the claim fails, and the layer answers 503).
const NO_EVICTION: &str = "noeviction";

/// What opening a [`RedisStore`](super::RedisStore) does when a Redis node's
/// `maxmemory-policy` may evict records (anything but `noeviction`); set with
/// [`RedisStoreBuilder::on_evicting_policy`](super::RedisStoreBuilder::on_evicting_policy).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnEvictingPolicy {
    /// Refuse to open the store with [`StoreError::EvictingPolicy`] (the default).
    #[default]
    Refuse,
    /// Open it, and log a warning naming the node and its policy: for a deployment that
    /// accepts that a key evicted under memory pressure may run again.
    Warn,
}

/// A Redis node runs with a `maxmemory-policy` that may evict live claims and completed
/// records, the source of [`StoreError::EvictingPolicy`].
///
/// ```
/// use tower_idempotency::store::{EvictingPolicy, StoreError};
/// fn evicting(error: &StoreError) -> Option<&EvictingPolicy> {
///     match error {
///         StoreError::EvictingPolicy(evicting) => Some(evicting),
///         _ => None,
///     }
/// }
/// # let _ = evicting;
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{} runs with maxmemory-policy {policy}, which evicts idempotency records (claims in \
     progress, completed responses) under memory pressure, and a duplicate of an evicted key \
     runs again: set `maxmemory-policy noeviction` on every node (full memory then fails \
     claims, answered 503), or open the store with \
     `on_evicting_policy(OnEvictingPolicy::Warn)` to accept the risk",
    node.as_deref().map_or_else(|| "the Redis server".to_owned(), |node| format!("Redis node {node}"))
)]
#[non_exhaustive]
pub struct EvictingPolicy {
    /// The node's address on a cluster (`host:port`); `None` on a single server.
    pub node: Option<String>,
    /// Its `maxmemory-policy`, for example `allkeys-lru`.
    pub policy: String,
}

/// Asks every node for its `maxmemory-policy`. A node that cannot be asked (`CONFIG` renamed
/// or forbidden, as managed services do) is logged as unverified, never refused; an evicting
/// one is refused or logged as `on_evicting` says. A failure to reach the server is
/// [`StoreError::Backend`].
pub(super) async fn check(
    connection: &Connection,
    on_evicting: OnEvictingPolicy,
) -> Result<(), StoreError> {
    let mut ask = redis::cmd("CONFIG");
    ask.arg("GET").arg("maxmemory-policy");
    for (node, answer) in connection.ask_every_node(&ask).await.map_err(backend)? {
        let at = node.as_deref().unwrap_or("the server");
        match policy_in(answer) {
            Ok(Some(policy)) if policy == NO_EVICTION => {}
            Ok(Some(policy)) => {
                let evicting = EvictingPolicy { node, policy };
                match on_evicting {
                    OnEvictingPolicy::Refuse => return Err(evicting.into()),
                    OnEvictingPolicy::Warn => {
                        tracing::warn!(error = %evicting, "Redis may evict idempotency records");
                    }
                }
            }
            Ok(None) => tracing::warn!(
                node = at,
                "Redis does not report its maxmemory-policy; make sure it is noeviction, or \
                 evicted idempotency records let duplicates run again"
            ),
            Err(error) if answered(&error) => tracing::warn!(
                node = at,
                %error,
                "cannot read Redis's maxmemory-policy (CONFIG GET refused); make sure it is \
                 noeviction, or evicted idempotency records let duplicates run again"
            ),
            Err(error) => return Err(backend(error)),
        }
    }
    Ok(())
}

/// The policy in a `CONFIG GET maxmemory-policy` answer (a name/value array in RESP2, a map in
/// RESP3), or `None` when the server has no such parameter.
fn policy_in(answer: RedisResult<Value>) -> RedisResult<Option<String>> {
    let settings: HashMap<String, String> = redis::from_redis_value(answer?.extract_error()?)?;
    Ok(settings
        .into_iter()
        .find(|(name, _)| name.eq_ignore_ascii_case("maxmemory-policy"))
        .map(|(_, policy)| policy.to_ascii_lowercase()))
}

/// The server answered with an error (an unknown or forbidden command), as opposed to not
/// answering at all.
fn answered(error: &RedisError) -> bool {
    matches!(error.kind(), ErrorKind::Server(_) | ErrorKind::Extension)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(text: &str) -> Value {
        Value::BulkString(text.as_bytes().to_vec())
    }

    #[test]
    fn reads_the_policy_from_either_protocol() {
        let resp2 = Value::Array(vec![bulk("maxmemory-policy"), bulk("allkeys-lru")]);
        assert_eq!(
            policy_in(Ok(resp2)).unwrap().as_deref(),
            Some("allkeys-lru")
        );
        let resp3 = Value::Map(vec![(bulk("maxmemory-policy"), bulk("noeviction"))]);
        assert_eq!(policy_in(Ok(resp3)).unwrap().as_deref(), Some("noeviction"));
        assert_eq!(policy_in(Ok(Value::Array(vec![]))).unwrap(), None);
    }

    #[test]
    fn names_the_node_and_what_to_do() {
        let on_cluster = EvictingPolicy {
            node: Some("10.0.0.1:6379".into()),
            policy: "volatile-lru".into(),
        };
        let text = on_cluster.to_string();
        assert!(
            text.starts_with("Redis node 10.0.0.1:6379 runs with maxmemory-policy volatile-lru")
        );
        assert!(text.contains("noeviction") && text.contains("OnEvictingPolicy::Warn"));
        let single = EvictingPolicy {
            node: None,
            policy: "allkeys-lfu".into(),
        };
        assert!(single.to_string().starts_with("the Redis server runs"));
    }
}
