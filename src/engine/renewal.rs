//! Keeping a claim's lease alive while its operation runs, beside it rather than inside it.
//!
//! The renewal runs beside the operation rather than inside its future, so an operation that
//! blocks its thread, or is not polled for a while, cannot starve it. It renews every quarter
//! of the lease and retries a failure after a sixteenth, each attempt bounded by the store
//! timeout; [`EngineConfig::validate`](super::config) refuses timings under which two failed
//! attempts in a row would outlast the lease.
//!
//! Most operations end long before their first renewal is due, so a claim does not get a task
//! of its own up front (a spawn, a timer and an abort per request): it is registered with the
//! engine's one renewer task, which gives a claim its own renewing task only when its first
//! renewal comes due.

mod registry;

use std::sync::Arc;

use tokio::{sync::Notify, task::JoinHandle, time::Instant};

use self::registry::Registry;
use super::{status::LostFlag, Engine};
use crate::{
    record::{StoreKey, Token},
    store::StoreError,
};

/// The claims of one engine (and its clones) that are held, and the task that renews them.
#[derive(Default)]
pub(crate) struct Renewals {
    registry: Registry<Waiting, JoinHandle<()>>,
    /// Wakes the renewer when a claim falls due before the time it sleeps until.
    wake: Notify,
}

struct Waiting {
    key: StoreKey,
    token: Token,
    claimed_at: Instant,
    lost: LostFlag,
}

/// The renewal of one claim; stopped when the claim settles (or is dropped).
#[derive(Debug)]
pub(crate) struct Renewal {
    renewals: Arc<Renewals>,
    due: Instant,
    id: u64,
    /// Set by the first `stop`: a settled claim's renewal is dropped right after, and a
    /// second look in the registry (its lock, a map search) found nothing to stop.
    stopped: bool,
}

impl Renewal {
    /// Starts renewing. `claimed_at` is taken before the claim was sent, so this process' idea
    /// of when the lease ends is never later than the store's.
    pub(crate) fn start(
        engine: Engine,
        key: StoreKey,
        token: Token,
        claimed_at: Instant,
        lost: LostFlag,
    ) -> Self {
        let renewals = engine.shared.renewals.clone();
        let due = claimed_at + engine.shared.config.renew_every();
        let waiting = Waiting {
            key,
            token,
            claimed_at,
            lost,
        };
        let registered = renewals
            .registry
            .register(due, waiting, || tokio::spawn(renewer(engine)));
        if registered.wake_renewer {
            renewals.wake.notify_one();
        }
        Self {
            renewals,
            due,
            id: registered.id,
            stopped: false,
        }
    }

    pub(crate) fn stop(&mut self) {
        if !std::mem::replace(&mut self.stopped, true) {
            self.renewals.registry.stop(self.due, self.id);
        }
    }
}

impl Drop for Renewal {
    fn drop(&mut self) {
        self.stop();
    }
}

impl std::fmt::Debug for Renewals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Renewals").finish_non_exhaustive()
    }
}

/// The engine's renewer: hands each claim whose first renewal is due a renewing task of its
/// own, then sleeps until the next one is due (or a claim due sooner is registered); ends
/// when no claim is left to watch.
async fn renewer(engine: Engine) {
    let renewals = engine.shared.renewals.clone();
    loop {
        let wake = renewals.wake.notified();
        tokio::pin!(wake);
        wake.as_mut().enable();
        let handed_out = renewals.registry.hand_out_due(Instant::now(), |waiting| {
            let Waiting {
                key,
                token,
                claimed_at,
                lost,
            } = waiting;
            tokio::spawn(renew(engine.clone(), key, token, claimed_at, lost))
        });
        // Nothing left to watch: end (the engine is not kept alive for nothing); the next
        // claim starts a renewer again.
        let Some(next) = handed_out else {
            return;
        };
        tokio::select! {
            () = &mut wake => {}
            () = tokio::time::sleep_until(next) => {}
        }
    }
}

async fn renew(engine: Engine, key: StoreKey, token: Token, claimed_at: Instant, lost: LostFlag) {
    let config = &engine.shared.config;
    let mut held_until = claimed_at + config.lease;
    let mut next = claimed_at + config.renew_every();
    loop {
        tokio::time::sleep_until(next).await;
        let attempt = Instant::now();
        match engine
            .bounded(engine.backend().renew(&key, token, config.lease))
            .await
        {
            Ok(()) => {
                tracing::trace!(key = %key.log_id(), "lease renewed");
                held_until = attempt + config.lease;
                lost.renewed(held_until);
                next = attempt + config.renew_every();
            }
            Err(StoreError::StaleToken) => {
                tracing::error!(key = %key.log_id(), "lease lost while the operation was running: another request took the key over");
                lost.set();
                return;
            }
            Err(error) if Instant::now() >= held_until => {
                tracing::error!(key = %key.log_id(), error = %error, "lease ran out while renewals failed; a duplicate may run the operation again");
                lost.set();
                return;
            }
            Err(error) => {
                tracing::warn!(key = %key.log_id(), error = %error, "lease renewal failed; retrying soon");
                next = Instant::now() + config.renew_retry();
            }
        }
    }
}

#[cfg(all(test, shuttle))]
mod shuttle_tests;

#[cfg(all(test, feature = "memory", not(shuttle)))]
mod tests {
    use bytes::Bytes;

    use crate::{
        engine::{Begin, Engine},
        record::{Fingerprint, StoreKey},
        store::MemoryStore,
    };

    /// A claim settled (completed or released) leaves nothing in the renewal registry, and its
    /// drop after the settle finds nothing more to stop.
    // mutant: `Renewal::stop` only sets `stopped` (never calls `registry.stop`) -> fails with
    // "(waiting, renewing) once settled, left: (1, 0) right: (0, 0)".
    #[tokio::test]
    async fn a_settled_claim_leaves_no_renewal_behind() {
        let engine = Engine::new(MemoryStore::new());
        let filed = || engine.shared.renewals.registry.filed();
        for (n, complete) in [(1, true), (2, false)] {
            let key = StoreKey::new("s", format!("k{n}"));
            let Begin::Run(claim) = engine
                .begin(key, Fingerprint::of([b"{}".as_slice()]))
                .await
                .unwrap()
            else {
                panic!("a new key runs");
            };
            assert_eq!(filed(), (1, 0), "(waiting, renewing) while held");
            if complete {
                claim.complete(Bytes::from_static(b"done")).await.unwrap();
            } else {
                claim.release().await.unwrap();
            }
            assert_eq!(filed(), (0, 0), "(waiting, renewing) once settled");
        }
    }
}
