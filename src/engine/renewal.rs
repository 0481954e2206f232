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

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
};

use tokio::{sync::Notify, task::JoinHandle, time::Instant};

use super::{status::LostFlag, Engine};
use crate::{
    record::{StoreKey, Token},
    store::StoreError,
};

/// The claims of one engine (and its clones) that are held, and the task that renews them.
#[derive(Default)]
pub(crate) struct Renewals {
    state: Mutex<State>,
    /// Wakes the renewer when a claim falls due before the time it sleeps until.
    wake: Notify,
}

#[derive(Default)]
struct State {
    /// Claims whose first renewal is not due yet, by due time.
    waiting: BTreeMap<(Instant, u64), Waiting>,
    /// Claims that fell due: their renewing task.
    renewing: HashMap<u64, JoinHandle<()>>,
    next_id: u64,
    renewer: Option<JoinHandle<()>>,
    /// When the renewer looks next.
    renewer_wakes_at: Option<Instant>,
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
        let mut state = renewals.lock();
        let id = state.next_id;
        state.next_id += 1;
        let waiting = Waiting {
            key,
            token,
            claimed_at,
            lost,
        };
        state.waiting.insert((due, id), waiting);
        let running = state
            .renewer
            .as_ref()
            .is_some_and(|task| !task.is_finished());
        if !running {
            // The first claim, or the runtime the renewer ran on is gone: one on this runtime.
            state.renewer_wakes_at = None;
            state.renewer = Some(tokio::spawn(renewer(engine)));
        } else if state.renewer_wakes_at.is_none_or(|at| due < at) {
            renewals.wake.notify_one();
        }
        drop(state);
        Self { renewals, due, id }
    }

    pub(crate) fn stop(&self) {
        let mut state = self.renewals.lock();
        if state.waiting.remove(&(self.due, self.id)).is_none() {
            if let Some(task) = state.renewing.remove(&self.id) {
                task.abort();
            }
        }
    }
}

impl Drop for Renewal {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Renewals {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every change under the lock is a single insert, removal or assignment.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
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
        let next = {
            let mut state = renewals.lock();
            let now = Instant::now();
            while let Some(entry) = state.waiting.first_entry() {
                let &(due, id) = entry.key();
                if due > now {
                    break;
                }
                let Waiting {
                    key,
                    token,
                    claimed_at,
                    lost,
                } = entry.remove();
                let task = tokio::spawn(renew(engine.clone(), key, token, claimed_at, lost));
                state.renewing.insert(id, task);
            }
            let Some(&(next, _)) = state.waiting.first_key_value().map(|(due, _)| due) else {
                // Nothing left to watch: end (the engine is not kept alive for nothing); the
                // next claim starts a renewer again. Decided under the lock, so a claim
                // registered meanwhile sees no renewer and starts one.
                state.renewer = None;
                state.renewer_wakes_at = None;
                return;
            };
            state.renewer_wakes_at = Some(next);
            next
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
