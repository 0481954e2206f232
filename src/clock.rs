//! Deadlines from configured durations. `Duration::MAX` is what users write for "no limit",
//! and `Instant::now() + Duration::MAX` panics: a deadline is saturated instead.

use std::time::Duration;

/// The longest wait a configured duration stands for: a longer one (up to `Duration::MAX`)
/// counts as this, which every clock adds to `now` without overflowing.
pub(crate) const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// `now + after`, with `after` saturated at [`FOREVER`] (the relay's and the consumer's
/// deadlines; the layer saturates its setting once, where it is given).
#[cfg(any(test, feature = "sqlx"))]
pub(crate) fn deadline_in(after: Duration) -> tokio::time::Instant {
    tokio::time::Instant::now() + after.min(FOREVER)
}

#[cfg(test)]
mod tests {
    use tokio::time::Instant;

    use super::*;

    #[test]
    fn no_duration_overflows_the_clock() {
        assert!(deadline_in(Duration::MAX) > Instant::now() + Duration::from_secs(3600));
        assert!(deadline_in(Duration::ZERO) <= Instant::now());
    }
}
