//! Which key prefixes the store accepts.

const MAX_PREFIX_LEN: usize = 256;

/// A key prefix that [`RedisStoreBuilder::build`](super::RedisStoreBuilder::build) refused,
/// with the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid Redis key prefix {prefix:?}: {reason}; use 1-256 bytes without whitespace or control characters")]
pub struct InvalidPrefix {
    /// The prefix as given.
    pub prefix: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// `prefix` when it is 1-256 bytes without whitespace or control characters.
pub(super) fn validate(prefix: String) -> Result<String, InvalidPrefix> {
    let reason = if prefix.is_empty() {
        Some("empty")
    } else if prefix.len() > MAX_PREFIX_LEN {
        Some("longer than 256 bytes")
    } else if prefix.chars().any(char::is_whitespace) {
        Some("contains whitespace")
    } else if prefix.chars().any(char::is_control) {
        Some("contains a control character")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(InvalidPrefix { prefix, reason }),
        None => Ok(prefix),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_validation() {
        for bad in [
            "",
            "a b",
            "a\tb",
            "line\n",
            "nul\0",
            "\u{7f}",
            &"x".repeat(257),
        ] {
            assert!(validate(bad.to_owned()).is_err(), "{bad:?}");
        }
        for good in ["tower-idempotency:", "{idem}:", "ünï:", "x"] {
            assert!(validate(good.to_owned()).is_ok(), "{good:?}");
        }
    }
}
