//! The example's environment, read once at start; a bad value stops it with a clear message.

use std::time::Duration;

use crate::pipeline::{number, var};

/// Every variable, its meaning and its default is listed in the `# Environment` table of
/// `main.rs`.
#[derive(Debug, Clone)]
pub struct Config {
    pub bind: String,
    pub database_url: Option<String>,
    /// `REDIS_CLUSTER_URLS`, or `REDIS_URL` (several comma-separated nodes name a cluster).
    pub redis: Option<Redis>,
    /// `REDIS_REPLICA_WAIT_MS`: wait this long for one replica to acknowledge each claim.
    pub redis_replica_wait: Option<Duration>,
    pub lease: Duration,
    pub retention: Duration,
    pub idempotency_disabled: bool,
    /// `IDEMPOTENCY_MEMORY_MB`: the memory store's byte budget (unset: the store's default).
    pub memory_budget: Option<u64>,
    pub handler_delay: Duration,
    pub delay_after_charge: Duration,
    pub fail_first: u64,
    pub mode: Mode,
    /// `AMQP_URL`, `NATS_URL`, `KAFKA_URL` or `SQS_URL` is set: every charge writes a `payment.created` event to the
    /// outbox (the broker itself is read by `pipeline::Broker`).
    pub events: bool,
    /// `OUTBOX_RELAY` (default `1`): relay the outbox in this process.
    pub outbox_relay: bool,
}

/// `IDEMPOTENCY_MODE`: how the claim, the charge and the stored response commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// All three in ONE database transaction (needs a SQL `DATABASE_URL`, no `REDIS_URL`).
    Transactional,
    /// The claim and the completion are their own store operations around the handler.
    Separate,
}

impl Config {
    pub fn from_env() -> Result<Self, String> {
        let database_url = var("DATABASE_URL");
        let redis = Redis::from_env()?;
        let events = crate::pipeline::Broker::named();
        if events && database_url.is_none() {
            return Err("AMQP_URL / NATS_URL / KAFKA_URL / SQS_URL need a SQL DATABASE_URL (postgres://, mysql:// or sqlite://): the payment.created events are written to its outbox table in the charge's transaction".to_owned());
        }
        let outbox_relay = match var("OUTBOX_RELAY").as_deref() {
            None | Some("1") => true,
            Some("0") => false,
            Some(other) => return Err(format!("OUTBOX_RELAY must be 0 or 1, got {other:?}")),
        };
        let mode = match var("IDEMPOTENCY_MODE").as_deref() {
            None if database_url.is_some() && redis.is_none() => Mode::Transactional,
            None | Some("separate") => Mode::Separate,
            Some("transactional") if redis.is_some() => {
                return Err("IDEMPOTENCY_MODE=transactional keeps the records in the payments database: unset REDIS_URL and REDIS_CLUSTER_URLS".to_owned())
            }
            Some("transactional") if database_url.is_none() => {
                return Err("IDEMPOTENCY_MODE=transactional needs a SQL DATABASE_URL (postgres://, mysql:// or sqlite://)".to_owned())
            }
            Some("transactional") => Mode::Transactional,
            Some(other) => {
                return Err(format!(
                    "IDEMPOTENCY_MODE must be \"transactional\" or \"separate\", got {other:?}"
                ))
            }
        };
        Ok(Self {
            mode,
            events,
            outbox_relay,
            bind: var("BIND").unwrap_or_else(|| "127.0.0.1:3000".to_owned()),
            database_url,
            redis,
            redis_replica_wait: match number("REDIS_REPLICA_WAIT_MS", 0)? {
                0 => None,
                ms => Some(Duration::from_millis(ms)),
            },
            lease: Duration::from_millis(number("IDEMPOTENCY_LEASE_MS", 30_000)?),
            retention: Duration::from_secs(number("IDEMPOTENCY_TTL_SECS", 86_400)?),
            idempotency_disabled: var("IDEMPOTENCY_DISABLED").as_deref() == Some("1"),
            memory_budget: match var("IDEMPOTENCY_MEMORY_MB") {
                None => None,
                Some(_) => Some(number::<u64>("IDEMPOTENCY_MEMORY_MB", 0)?.saturating_mul(1 << 20)),
            },
            handler_delay: Duration::from_millis(number("PAYMENTS_HANDLER_DELAY_MS", 0)?),
            delay_after_charge: Duration::from_millis(number("PAYMENTS_DELAY_AFTER_CHARGE_MS", 0)?),
            fail_first: number("PAYMENTS_FAIL_FIRST", 0)?,
        })
    }
}

/// Where the idempotency records go when Redis is configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Redis {
    /// One server: `REDIS_URL=redis://host:6379`.
    Single(String),
    /// A Redis Cluster, given by some of its nodes: `REDIS_CLUSTER_URLS=redis://a:7000,...`,
    /// or `REDIS_URL` with several comma-separated nodes.
    Cluster(Vec<String>),
}

impl Redis {
    fn from_env() -> Result<Option<Self>, String> {
        match (var("REDIS_CLUSTER_URLS"), var("REDIS_URL")) {
            (Some(_), Some(_)) => Err("set REDIS_URL or REDIS_CLUSTER_URLS, not both".to_owned()),
            (Some(nodes), None) => Self::parse(&nodes, "REDIS_CLUSTER_URLS", true).map(Some),
            (None, Some(url)) => Self::parse(&url, "REDIS_URL", false).map(Some),
            (None, None) => Ok(None),
        }
    }

    fn parse(text: &str, name: &str, cluster: bool) -> Result<Self, String> {
        let nodes: Vec<String> = text
            .split(',')
            .map(str::trim)
            .filter(|node| !node.is_empty())
            .map(str::to_owned)
            .collect();
        match nodes.as_slice() {
            [] => Err(format!("{name}={text:?} names no Redis node")),
            [single] if !cluster => Ok(Self::Single(single.clone())),
            _ => Ok(Self::Cluster(nodes)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Redis;

    #[test]
    fn one_url_is_a_server_several_or_the_cluster_variable_a_cluster() {
        let url = "redis://127.0.0.1:6379";
        assert_eq!(
            Redis::parse(url, "REDIS_URL", false),
            Ok(Redis::Single(url.to_owned()))
        );
        assert_eq!(
            Redis::parse(url, "REDIS_CLUSTER_URLS", true),
            Ok(Redis::Cluster(vec![url.to_owned()]))
        );
        assert_eq!(
            Redis::parse("redis://a:7000, redis://b:7001,", "REDIS_URL", false),
            Ok(Redis::Cluster(vec![
                "redis://a:7000".to_owned(),
                "redis://b:7001".to_owned()
            ]))
        );
        assert!(Redis::parse(" , ", "REDIS_URL", false).is_err());
    }
}
