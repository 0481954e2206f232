//! [`Engine::run_steps`]: `run_once` for an operation made of steps.

use std::future::Future;

use bytes::Bytes;

use super::{Journal, KeyOwner, Steps};
use crate::{
    engine::Execution,
    engine::{Begin, Engine, RunError},
    record::{Fingerprint, StoreKey},
};

impl Engine {
    /// [`run_once`](Self::run_once) for an operation made of steps: `operation` gets a
    /// [`Steps`] handle on `journal`, through which steps finished by an earlier attempt
    /// (one that failed, or whose owner died or lost its lease) hand back their outputs
    /// instead of running again. The final output is recorded and replayed as with `run_once`.
    ///
    /// A failing operation releases the key as `run_once` does; its journaled steps stay, so
    /// the next attempt resumes after them.
    pub async fn run_steps<J, F, Fut, E>(
        &self,
        journal: J,
        key: StoreKey,
        fingerprint: Fingerprint,
        operation: F,
    ) -> Result<Execution, RunError<E>>
    where
        J: Journal,
        F: FnOnce(Steps<J>) -> Fut,
        Fut: Future<Output = Result<Bytes, E>>,
    {
        let claim = match self.begin(key, fingerprint).await? {
            Begin::Replay(output) => return Ok(Execution::Replayed(output)),
            Begin::Run(claim) => claim,
        };
        let steps = match Steps::resume(journal, KeyOwner::of(&claim)).await {
            Ok(steps) => steps,
            Err(source) => {
                let key = claim.key().clone();
                let _ = claim.release().await;
                return Err(RunError::Engine(self.unavailable(&key, source)));
            }
        };
        let result = claim.run(operation(steps)).await;
        Self::settle(claim, result).await
    }
}
