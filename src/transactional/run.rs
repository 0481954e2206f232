//! [`Transactional::run_once`]: the message-consumer form of the mode, the seed's
//! `INSERT .. ON CONFLICT DO NOTHING` plus the work, in one transaction.

use bytes::Bytes;
use futures_util::future::BoxFuture;

use super::{owner::CommitError, StillBorrowed, Transactional, TransactionalStore, TxBegin};
use crate::{
    engine::{EngineError, Execution},
    record::{Fingerprint, StoreKey},
};

/// Why [`Transactional::run_once`] failed. Nothing of the operation persists, except after
/// [`CommitError::OutcomeUnknown`], when it may have committed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TxRunError<E> {
    /// The operation was not run (a duplicate still running, the key reused with another
    /// fingerprint, the store down).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The operation failed; its transaction was rolled back, so a retry runs it again.
    #[error("the operation failed; its transaction was rolled back so that a retry runs it again")]
    Operation(#[source] E),
    /// The operation succeeded but its transaction could not commit: its writes were rolled
    /// back with the claim, so a retry runs it again. With [`CommitError::OutcomeUnknown`] the
    /// commit may have gone through; a retry with the key replays it if so.
    #[error(transparent)]
    Commit(#[from] CommitError),
}

impl<S: TransactionalStore> Transactional<S> {
    /// Runs `operation` on a transaction unless it already ran under `key`, and returns its
    /// output either way (a run that loses the key to a concurrent one at its commit is rolled
    /// back and returns the winner's output as replayed). The operation's writes, the claim and the output commit together;
    /// a failing operation (or a panicking one, or a crash) leaves nothing behind.
    ///
    /// The closure gets the transaction's connection; box its future (`Box::pin(async move
    /// { .. })`), as with sqlx's `Connection::transaction`.
    ///
    /// There is no form with steps (recovery points): the claim is an uncommitted row of this
    /// one transaction, so no journal entry could be fenced by it and outlive a crash. An
    /// operation that also calls other systems uses
    /// [`Engine::run_steps`](crate::Engine::run_steps) with the SQL journal of its database
    /// instead (see the `steps` module).
    pub async fn run_once<F, E>(
        &self,
        key: StoreKey,
        fingerprint: Fingerprint,
        operation: F,
    ) -> Result<Execution, TxRunError<E>>
    where
        F: for<'c> FnOnce(
            &'c mut <S::Database as sqlx::Database>::Connection,
        ) -> BoxFuture<'c, Result<Bytes, E>>,
    {
        let owner = match self.begin(key.clone(), fingerprint).await? {
            TxBegin::Replay(output) => return Ok(Execution::Replayed(output)),
            TxBegin::Run(owner) => owner,
        };
        // A new owner's transaction is always open in its slot.
        let Ok(mut tx) = owner.transaction().lock().await else {
            return Err(CommitError::StillBorrowed(StillBorrowed).into());
        };
        let result = operation(&mut tx).await;
        drop(tx);
        match result {
            Ok(output) => match owner.commit(output.clone()).await {
                Ok(()) => Ok(Execution::Ran(output)),
                // Another consumer recorded the key first: its output is the one that counts.
                Err(CommitError::KeyTaken) => match self.wait_for(key, fingerprint).await? {
                    TxBegin::Replay(output) => Ok(Execution::Replayed(output)),
                    TxBegin::Run(owner) => {
                        // Free again already (the record expired): this attempt rolled back,
                        // and the operation, consumed, cannot run here a second time.
                        owner.rollback().await;
                        Err(CommitError::KeyTaken.into())
                    }
                },
                Err(error) => Err(error.into()),
            },
            Err(error) => {
                owner.rollback().await;
                Err(TxRunError::Operation(error))
            }
        }
    }
}
