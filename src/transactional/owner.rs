//! The owner of a key in the transactional mode: its transaction, lent to the operation,
//! then committed together with the stored outcome, or rolled back.

use std::{sync::Arc, time::Duration};

use super::{
    dialect::{TransactionalStore, TxCommit, TxDialect},
    local::LocalOwnership,
    open_tx::OpenTx,
    slot::{StillBorrowed, TxSlot},
    turn::WriterTurn,
    Transactional,
};
use crate::{
    engine::{in_flight::InFlightGuard, Engine},
    record::{Fingerprint, StoreKey, Token},
    store::StoreError,
};
use bytes::Bytes;

/// This caller's transaction holds a key (or, for unkeyed work, is simply open).
///
/// Lend the transaction to the operation with [`transaction`](Self::transaction), then end
/// with [`commit`](Self::commit) (the outcome is stored and replayed to duplicates, the
/// operation's writes persist) or [`rollback`](Self::rollback) (nothing persists and a retry
/// runs again). Dropping it rolls back too.
#[must_use = "an owner must commit or roll back"]
pub struct TxOwner<DB: sqlx::Database> {
    slot: TxSlot<DB>,
    claim: Option<ClaimRow>,
    dialect: Arc<dyn TxDialect<DB>>,
    engine: Engine,
    /// Unkeyed work: held until the transaction has ended, so `Engine::drained` waits for it
    /// (a claimed key's mark counts it instead).
    _in_flight: Option<InFlightGuard>,
}

/// The key this transaction claimed.
struct ClaimRow {
    key: StoreKey,
    fingerprint: Fingerprint,
    token: Token,
    /// Dropped after the transaction ended: wakes this process' waiters on the key and counts
    /// the owner out of `Engine::drained`.
    _local: LocalOwnership,
    /// Where the database has one writer at a time, this owner's turn: the next owner of
    /// this process begins once this transaction has ended.
    _turn: Option<WriterTurn>,
}

/// Why [`TxOwner::commit`] did not commit, or cannot say whether it did. Nothing of the
/// transaction persists, except after [`OutcomeUnknown`](Self::OutcomeUnknown).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommitError {
    /// The operation still holds the transaction.
    #[error(transparent)]
    StillBorrowed(#[from] StillBorrowed),
    /// Writing the outcome or committing failed: the server refused it (or it never reached
    /// the `COMMIT`), so nothing of it persists.
    #[error("the idempotency transaction could not be committed; nothing of it persists")]
    Store(#[source] StoreError),
    /// The connection broke, or the store stopped answering, while the `COMMIT` was under
    /// way: the transaction may have committed (effects and record together) or not (nothing).
    /// The key is not left claimed either way — the server ended the transaction, and with
    /// it the claim — so the next request with the key learns the outcome: it replays the
    /// committed record, or runs once if there is none.
    #[error("the connection broke during the commit; the idempotency transaction may or may not have committed: retry with the same key to learn its outcome")]
    OutcomeUnknown(#[source] StoreError),
    /// Another request recorded the key first (a race the claim could not see, or, on a
    /// Galera cluster, a commit that lost its certification to the same key committed on
    /// another node): nothing of this transaction persists. Treat the request as a duplicate: wait for the key's
    /// outcome and replay it (the HTTP layer and `run_once` do).
    #[error("another request recorded this idempotency key first; nothing of this attempt persists, replay the recorded outcome")]
    KeyTaken,
}

impl CommitError {
    /// A store error of the commit: one that cannot tell whether the `COMMIT` went through
    /// (a broken connection; a time-out, after which the server may still commit) is
    /// [`OutcomeUnknown`](Self::OutcomeUnknown).
    fn from_store(error: StoreError) -> Self {
        match error {
            StoreError::CommitOutcomeUnknown { .. } | StoreError::Timeout { .. } => {
                Self::OutcomeUnknown(error)
            }
            error => Self::Store(error),
        }
    }
}

impl<DB: sqlx::Database> TxOwner<DB> {
    pub(super) fn claimed<S: TransactionalStore<Database = DB>>(
        mode: &Transactional<S>,
        tx: OpenTx<DB>,
        key: StoreKey,
        fingerprint: Fingerprint,
        token: Token,
        local: LocalOwnership,
        turn: Option<WriterTurn>,
    ) -> Self {
        let mut owner = Self::with_slot(mode, TxSlot::open(tx), None);
        owner.claim = Some(ClaimRow {
            key,
            fingerprint,
            token,
            _local: local,
            _turn: turn,
        });
        owner
    }

    /// Unkeyed work: the transaction is begun when the operation first locks it.
    pub(super) fn unkeyed<S: TransactionalStore<Database = DB>>(mode: &Transactional<S>) -> Self {
        let slot = TxSlot::lazy(mode.dialect.clone(), mode.engine.shared.config.lease);
        Self::with_slot(mode, slot, Some(mode.engine.shared.in_flight.enter()))
    }

    fn with_slot<S: TransactionalStore<Database = DB>>(
        mode: &Transactional<S>,
        slot: TxSlot<DB>,
        in_flight: Option<InFlightGuard>,
    ) -> Self {
        Self {
            slot,
            claim: None,
            dialect: mode.dialect.clone(),
            engine: mode.engine.clone(),
            _in_flight: in_flight,
        }
    }

    /// The transaction, to lend to the operation (the HTTP layer puts a clone into the
    /// request's extensions).
    pub fn transaction(&self) -> &TxSlot<DB> {
        &self.slot
    }

    /// The claimed key; `None` for unkeyed work.
    pub fn key(&self) -> Option<&StoreKey> {
        self.claim.as_ref().map(|claim| &claim.key)
    }

    /// Stores `payload` as the key's outcome in the transaction and commits it with the
    /// operation's writes. For unkeyed work the payload is ignored and the transaction simply
    /// commits. On error nothing persists, unless the outcome is unknown (see [`CommitError`]).
    pub async fn commit(self, payload: Bytes) -> Result<(), CommitError> {
        let Some(tx) = self.slot.take()? else {
            // Unkeyed work that never used its transaction: nothing to commit.
            return Ok(());
        };
        let engine = &self.engine;
        let Some(claim) = &self.claim else {
            return engine
                .bounded(self.dialect.commit(tx))
                .await
                .map_err(CommitError::from_store);
        };
        let retention: Duration = engine.shared.config.retention;
        let committed = engine
            .bounded(self.dialect.commit_with(
                tx,
                &claim.key,
                &claim.fingerprint,
                claim.token,
                payload,
                retention,
            ))
            .await
            .map_err(CommitError::from_store)?;
        match committed {
            TxCommit::Committed => {
                tracing::debug!(key = %claim.key.log_id(), "committed with its outcome");
                Ok(())
            }
            TxCommit::KeyTaken => {
                tracing::debug!(key = %claim.key.log_id(), "key recorded by another request first; rolled back");
                Err(CommitError::KeyTaken)
            }
        }
    }

    /// Rolls the transaction back: the operation's writes and the claim vanish, and the next
    /// request with the key runs again. If the operation still holds the transaction, it rolls
    /// back when the operation lets go of it.
    ///
    /// Bounded by the engine's store time limit, like every store call: a `ROLLBACK` that the
    /// database does not answer in time (a network gone silent) is abandoned, and the
    /// transaction is dropped with it, which closes (or, for a sqlx transaction, rolls back on
    /// its next use) its connection. Nothing of it can commit either way.
    pub async fn rollback(self) {
        self.roll_back(false).await;
    }

    /// Rolls the transaction back like [`rollback`](Self::rollback), and says whether the
    /// database had rolled it back already under the operation (then the claim went with it,
    /// and the key may have been recorded by another request since: the operation's own
    /// failure is not the request's outcome). `false` when it cannot tell.
    pub(crate) async fn rollback_lost(self) -> bool {
        self.roll_back(true).await
    }

    /// Both rollbacks; only `ask_lost` spends the extra question (a round trip on MariaDB).
    async fn roll_back(self, ask_lost: bool) -> bool {
        let Ok(Some(tx)) = self.slot.take() else {
            return false;
        };
        let rollback = async {
            if ask_lost {
                self.dialect.rollback_lost(tx).await
            } else {
                self.dialect.rollback(tx).await.map(|()| false)
            }
        };
        match self.engine.bounded(rollback).await {
            Ok(lost) => lost,
            Err(error) => {
                // The connection is gone, or silent and now dropped: the server ends the
                // transaction with it.
                tracing::debug!(error = %error, "rollback failed; the server ends the transaction with the connection");
                false
            }
        }
    }
}

impl<DB: sqlx::Database> std::fmt::Debug for TxOwner<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxOwner")
            .field("key", &self.key())
            .finish_non_exhaustive()
    }
}
