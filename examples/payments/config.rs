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
    pub delay_after_charge: Duration,
    pub fail_first: u64,
    pub mode: Mode,
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
        let redis_url = var("REDIS_URL");
        let mode = match var("IDEMPOTENCY_MODE").as_deref() {
            None if database_url.is_some() && redis_url.is_none() => Mode::Transactional,
            None | Some("separate") => Mode::Separate,
            Some("transactional") if redis_url.is_some() => {
                return Err("IDEMPOTENCY_MODE=transactional keeps the records in the payments database: unset REDIS_URL".to_owned())
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
            bind: var("BIND").unwrap_or_else(|| "127.0.0.1:3000".to_owned()),
            database_url,
            redis_url,
            lease: Duration::from_millis(number("IDEMPOTENCY_LEASE_MS", 30_000)?),
            retention: Duration::from_secs(number("IDEMPOTENCY_TTL_SECS", 86_400)?),
            idempotency_disabled: var("IDEMPOTENCY_DISABLED").as_deref() == Some("1"),
            handler_delay: Duration::from_millis(number("PAYMENTS_HANDLER_DELAY_MS", 0)?),
            delay_after_charge: Duration::from_millis(number("PAYMENTS_DELAY_AFTER_CHARGE_MS", 0)?),
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
