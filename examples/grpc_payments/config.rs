//! The example's environment, read once at start; a bad value stops it with a message
//! naming the variable.

use std::time::Duration;

/// Every variable is listed in the `# Environment` table of `main.rs`.
#[derive(Debug, Clone)]
pub struct Config {
    pub bind: String,
    /// A `postgres://` URL: charges and idempotency records in that database.
    pub database_url: Option<String>,
    pub idempotency_disabled: bool,
    pub handler_delay: Duration,
}

impl Config {
    pub fn from_env() -> Result<Self, String> {
        let database_url = var("DATABASE_URL");
        if let Some(url) = &database_url {
            if !url.starts_with("postgres://") && !url.starts_with("postgresql://") {
                return Err(format!(
                    "DATABASE_URL={url:?}: this example speaks PostgreSQL only (postgres://...)"
                ));
            }
        }
        let idempotency_disabled = match var("IDEMPOTENCY_DISABLED").as_deref() {
            None | Some("0") => false,
            Some("1") => true,
            Some(other) => {
                return Err(format!(
                    "IDEMPOTENCY_DISABLED must be 0 or 1, got {other:?}"
                ))
            }
        };
        let delay = var("PAYMENTS_HANDLER_DELAY_MS").unwrap_or_else(|| "0".to_owned());
        let delay: u64 = delay.parse().map_err(|_| {
            format!("PAYMENTS_HANDLER_DELAY_MS={delay:?} is not a non-negative integer")
        })?;
        Ok(Self {
            bind: var("BIND").unwrap_or_else(|| "127.0.0.1:50051".to_owned()),
            database_url,
            idempotency_disabled,
            handler_delay: Duration::from_millis(delay),
        })
    }
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}
