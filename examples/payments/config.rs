//! The example's environment, read once at start; a bad value stops it with a clear message.

use std::{str::FromStr, time::Duration};

/// See `shared/payments-example.md` for each variable.
#[derive(Debug, Clone)]
pub struct Config {
    pub bind: String,
    pub database_url: Option<String>,
    pub redis_url: Option<String>,
    pub lease: Duration,
    pub retention: Duration,
    pub idempotency_disabled: bool,
    pub handler_delay: Duration,
    pub fail_first: u64,
}

impl Config {
    pub fn from_env() -> Result<Self, String> {
        Ok(Self {
            bind: var("BIND").unwrap_or_else(|| "127.0.0.1:3000".to_owned()),
            database_url: var("DATABASE_URL"),
            redis_url: var("REDIS_URL"),
            lease: Duration::from_millis(number("IDEMPOTENCY_LEASE_MS", 30_000)?),
            retention: Duration::from_secs(number("IDEMPOTENCY_TTL_SECS", 86_400)?),
            idempotency_disabled: var("IDEMPOTENCY_DISABLED").as_deref() == Some("1"),
            handler_delay: Duration::from_millis(number("PAYMENTS_HANDLER_DELAY_MS", 0)?),
            fail_first: number("PAYMENTS_FAIL_FIRST", 0)?,
        })
    }
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn number<T: FromStr>(name: &str, default: T) -> Result<T, String> {
    match var(name) {
        None => Ok(default),
        Some(text) => text
            .parse()
            .map_err(|_| format!("{name}={text:?} is not a valid non-negative integer")),
    }
}
