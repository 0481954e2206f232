//! [`Steps`]: the handle an operation runs its steps through.

use std::{
    collections::HashMap,
    future::Future,
    sync::{Arc, Mutex, PoisonError},
};

use bytes::Bytes;
use serde::{de::DeserializeOwned, Serialize};

use super::{Journal, KeyOwner, StepError};
use crate::store::StoreError;

/// The steps of one keyed operation: finished ones hand back their journaled output without
/// running, unfinished ones run and are journaled under the claim. Cheap to clone.
///
/// Step names identify steps across retries: give each step of an operation its own fixed
/// name, and run the same steps in the same order on every attempt. Names starting with `@`
/// are the [`Completer`](super::Completer)'s.
pub struct Steps<J> {
    inner: Arc<Inner<J>>,
}

struct Inner<J> {
    journal: J,
    owner: KeyOwner,
    /// The journal as read when the operation (re)started, plus what this attempt added.
    done: Mutex<HashMap<String, Bytes>>,
}

impl<J> Clone for Steps<J> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<J: Journal> Steps<J> {
    /// The steps of the operation `owner` runs, with what `journal` holds of earlier attempts.
    /// An HTTP handler takes `owner` from its request's extensions.
    pub async fn resume(journal: J, owner: KeyOwner) -> Result<Self, StoreError> {
        let done = journal.entries(&owner.key, &owner.fingerprint).await?;
        Ok(Self {
            inner: Arc::new(Inner {
                journal,
                owner,
                done: Mutex::new(done.into_iter().collect()),
            }),
        })
    }

    /// The claim the steps run under.
    pub fn owner(&self) -> &KeyOwner {
        &self.inner.owner
    }

    /// The journal the steps are recorded in.
    pub fn journal(&self) -> &J {
        &self.inner.journal
    }

    /// How many steps are journaled (by this attempt or earlier ones).
    pub fn finished(&self) -> usize {
        self.done_map().len()
    }

    /// A call to another system that honours idempotency keys. `call` gets the key derived
    /// for this step ([`KeyOwner::derive`]): send it downstream as its `Idempotency-Key`. Its
    /// output is journaled, fenced by the claim's token; if the step was journaled by an earlier
    /// attempt, its output is returned and `call` does not run.
    ///
    /// A crash between the call and its journal entry makes the next attempt call again with
    /// the same key: one effect if the downstream honours keys, at least one otherwise.
    pub async fn foreign<T, E, F, Fut>(&self, step: &str, call: F) -> Result<T, StepError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        if let Some(output) = self.journaled(step)? {
            return Ok(output);
        }
        // Narrows the window: a claim known to be lost must not call downstream at all.
        if self.inner.owner.status.is_lost() {
            return Err(StepError::Fenced {
                step: step.to_owned(),
            });
        }
        let output = call(KeyOwner::derive(&self.inner.owner.key, step))
            .await
            .map_err(|source| StepError::Step {
                step: step.to_owned(),
                source,
            })?;
        let bytes = encode(step, &output)?;
        self.inner
            .journal
            .append(&self.inner.owner, step, bytes.clone())
            .await
            .map_err(|e| StepError::journal(step, e))?;
        self.remember(step, bytes);
        Ok(output)
    }

    /// The journaled output of `step`, if an attempt finished it.
    pub(crate) fn journaled<T: DeserializeOwned, E>(
        &self,
        step: &str,
    ) -> Result<Option<T>, StepError<E>> {
        let Some(bytes) = self.done_map().get(step).cloned() else {
            return Ok(None);
        };
        tracing::debug!(key = %self.inner.owner.key.lazy_log_id(), step, "step already journaled; not running it again");
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|source| StepError::Output {
                step: step.to_owned(),
                source,
            })
    }

    /// The journaled output of `step` as stored, if an attempt finished it.
    pub(crate) fn raw(&self, step: &str) -> Option<Bytes> {
        self.done_map().get(step).cloned()
    }

    pub(crate) fn remember(&self, step: &str, output: Bytes) {
        self.done_map().insert(step.to_owned(), output);
    }

    fn done_map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Bytes>> {
        self.inner
            .done
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// A step's output as journaled: JSON.
pub(crate) fn encode<T: Serialize, E>(step: &str, output: &T) -> Result<Bytes, StepError<E>> {
    serde_json::to_vec(output)
        .map(Bytes::from)
        .map_err(|source| StepError::Output {
            step: step.to_owned(),
            source,
        })
}

impl<J> std::fmt::Debug for Steps<J> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Steps")
            .field("owner", &self.inner.owner)
            .finish_non_exhaustive()
    }
}
