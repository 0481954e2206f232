//! [`StepError`]: why a step did not hand back an output.

use crate::store::StoreError;

/// Why a step of a keyed operation did not finish.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StepError<E> {
    /// The step's own code failed; nothing was journaled (a local phase rolled its writes
    /// back). Fail the operation: its claim is released and a retry resumes at this step.
    #[error("step {step:?} failed; a retry resumes at it")]
    Step {
        /// The step's name.
        step: String,
        /// The step's error.
        #[source]
        source: E,
    },

    /// The claim is no longer this operation's: its lease ran out and another request may be
    /// running the key, so the step's entry was refused (a local phase's writes were rolled
    /// back). Stop without answering as if the step were done: the new owner finishes it.
    #[error("step {step:?} was not journaled: this request no longer holds its key (the lease ran out and the key may have been taken over)")]
    Fenced {
        /// The step's name.
        step: String,
    },

    /// The journal's database failed. A local phase's writes were rolled back; a foreign
    /// call's effect happened but is not journaled, and a retry calls again with the same
    /// derived key (harmless when the downstream honours it).
    #[error("the journal failed at step {step:?}; retry the operation later")]
    Store {
        /// The step's name.
        step: String,
        /// The journal's error.
        #[source]
        source: StoreError,
    },

    /// A step's output could not be serialised, or a journaled one deserialised (the step's
    /// output type changed since it was written).
    #[error("the output of step {step:?} could not be (de)serialised")]
    Output {
        /// The step's name.
        step: String,
        /// The serde error.
        #[source]
        source: serde_json::Error,
    },
}

impl<E> StepError<E> {
    /// From a journal write: a stale token means the claim was lost.
    pub(crate) fn journal(step: &str, source: StoreError) -> Self {
        match source {
            StoreError::StaleToken => Self::Fenced {
                step: step.to_owned(),
            },
            source => Self::Store {
                step: step.to_owned(),
                source,
            },
        }
    }
}
