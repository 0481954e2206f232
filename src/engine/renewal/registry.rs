//! Which claims wait for their first renewal, which have a renewing task, and whether the
//! renewer runs: the bookkeeping of [`Renewals`](super::Renewals) without its tokio tasks and
//! wake-up, on `crate::sync` so the shuttle tests can schedule it.

use std::{
    collections::{BTreeMap, HashMap},
    sync::PoisonError,
};

use tokio::{task::JoinHandle, time::Instant};

use crate::sync::{Mutex, MutexGuard};

/// A task the registry keeps: the renewer, or one claim's renewing task.
pub(crate) trait Task {
    /// Whether it ended (or the runtime it ran on is gone).
    fn is_finished(&self) -> bool;
    /// Stops it.
    fn abort(&self);
}

impl Task for JoinHandle<()> {
    fn is_finished(&self) -> bool {
        JoinHandle::is_finished(self)
    }

    fn abort(&self) {
        JoinHandle::abort(self);
    }
}

/// The held claims `C` of one engine and their tasks `T`.
pub(crate) struct Registry<C, T> {
    state: Mutex<State<C, T>>,
}

struct State<C, T> {
    /// Claims whose first renewal is not due yet, by due time.
    waiting: BTreeMap<(Instant, u64), C>,
    /// Claims that fell due: their renewing task.
    renewing: HashMap<u64, T>,
    next_id: u64,
    renewer: Option<T>,
    /// When the renewer looks next.
    renewer_wakes_at: Option<Instant>,
}

/// A claim just registered: its id, and whether the running renewer must be woken to look
/// (it sleeps past the claim's due time).
pub(crate) struct Registered {
    pub(crate) id: u64,
    pub(crate) wake_renewer: bool,
}

impl<C, T> Default for Registry<C, T> {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                waiting: BTreeMap::new(),
                renewing: HashMap::new(),
                next_id: 0,
                renewer: None,
                renewer_wakes_at: None,
            }),
        }
    }
}

impl<C, T: Task> Registry<C, T> {
    /// Files `claim`, due for its first renewal at `due`, and starts a renewer with
    /// `spawn_renewer` if none runs (the first claim, or the runtime the renewer ran on is
    /// gone), under the lock, so a renewer deciding to end meanwhile cannot miss it.
    pub(crate) fn register(
        &self,
        due: Instant,
        claim: C,
        spawn_renewer: impl FnOnce() -> T,
    ) -> Registered {
        let mut state = self.lock();
        let id = state.next_id;
        state.next_id += 1;
        state.waiting.insert((due, id), claim);
        let running = state
            .renewer
            .as_ref()
            .is_some_and(|task| !task.is_finished());
        let mut wake_renewer = false;
        if !running {
            state.renewer_wakes_at = None;
            state.renewer = Some(spawn_renewer());
        } else if state.renewer_wakes_at.is_none_or(|at| due < at) {
            wake_renewer = true;
        }
        Registered { id, wake_renewer }
    }

    /// Forgets the claim registered as `id` at `due`, stopping its renewing task if it has one.
    pub(crate) fn stop(&self, due: Instant, id: u64) {
        let mut state = self.lock();
        if state.waiting.remove(&(due, id)).is_none() {
            if let Some(task) = state.renewing.remove(&id) {
                task.abort();
            }
        }
    }

    /// The renewer's look: hands each claim due by `now` to a renewing task of its own
    /// (`renew` starts it), then returns when the next claim is due, or `None` when none is
    /// left, having forgotten the renewer under the lock (so a claim registered after this
    /// sees no renewer and starts one).
    pub(crate) fn hand_out_due(
        &self,
        now: Instant,
        mut renew: impl FnMut(C) -> T,
    ) -> Option<Instant> {
        let mut state = self.lock();
        while let Some(entry) = state.waiting.first_entry() {
            let &(due, id) = entry.key();
            if due > now {
                break;
            }
            let task = renew(entry.remove());
            state.renewing.insert(id, task);
        }
        let Some(&(next, _)) = state.waiting.first_key_value().map(|(due, _)| due) else {
            state.renewer = None;
            state.renewer_wakes_at = None;
            return None;
        };
        state.renewer_wakes_at = Some(next);
        Some(next)
    }

    /// How many claims wait for their first renewal and how many have a renewing task (the
    /// tests' check that nothing is left behind).
    #[cfg(all(test, any(shuttle, feature = "memory")))]
    pub(crate) fn filed(&self) -> (usize, usize) {
        let state = self.lock();
        (state.waiting.len(), state.renewing.len())
    }

    fn lock(&self) -> MutexGuard<'_, State<C, T>> {
        // Every change under the lock is a single insert, removal or assignment.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
