use std::time::Duration;

use tokio::task::JoinHandle;

use super::Store;

/// Starts a tokio task that deletes expired records of `store` every `every`, in batches of
/// `batch` until a batch comes back short, so no single statement holds long locks. Failures
/// are logged (`tracing`, warn level) and retried at the next tick. The task runs until
/// aborted: keep the handle and call [`JoinHandle::abort`] on shutdown (dropping the handle
/// does not stop it).
///
/// `every` is raised to at least one millisecond and `batch` to at least one record. Several
/// processes may each run a purger on one database. Redis and the memory store expire records
/// by themselves and need none.
///
/// Must be called within a tokio runtime.
///
/// ```no_run
/// # use std::time::Duration;
/// # use tower_idempotency::store::{spawn_purger, PostgresStore};
/// # fn example(store: PostgresStore) {
/// let purger = spawn_purger(store.clone(), Duration::from_secs(60), 1_000);
/// // ... on shutdown:
/// purger.abort();
/// # }
/// ```
pub fn spawn_purger<S: Store>(store: S, every: Duration, batch: u32) -> JoinHandle<()> {
    let batch = batch.max(1);
    let mut ticks = tokio::time::interval(every.max(Duration::from_millis(1)));
    // After a slow purge, wait a full period again rather than firing a burst of ticks.
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::spawn(async move {
        loop {
            ticks.tick().await;
            let mut purged = 0;
            loop {
                match store.purge_expired(batch).await {
                    Ok(n) => {
                        purged += n;
                        if n < u64::from(batch) {
                            break;
                        }
                    }
                    Err(error) => {
                        tracing::warn!(%error, "purging expired idempotency records failed");
                        break;
                    }
                }
            }
            if purged > 0 {
                tracing::debug!(purged, "purged expired idempotency records");
            }
        }
    })
}
