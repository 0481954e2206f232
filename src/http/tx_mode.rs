//! The transactional mode without its database type: what the layer's configuration holds
//! ([`SharedTxMode`]) and what a keyed request gets from it ([`HttpBegin`], [`HttpOwner`]), so
//! that the layer and its service stay free of a database type parameter.
//!
//! Kept apart from `transactional.rs` (which runs a request on a transaction and renders its
//! answers) so that the configuration depends on this erasure only, and the modules form no
//! circle: `transactional` → `answer` → `config` → `tx_mode`.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

use crate::{
    engine::EngineError,
    record::{Fingerprint, StoreKey},
    transactional::{CommitError, Transactional, TransactionalStore, TxBegin, TxOwner},
};

/// What the layer needs of [`Transactional`], whatever its database.
#[async_trait]
pub(crate) trait TxMode: Send + Sync {
    /// See [`Transactional::try_begin`]: `None` when the caller must wait.
    async fn try_begin(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
    ) -> Result<Option<HttpBegin>, EngineError>;
    /// See [`Transactional::wait_for`].
    async fn wait_for(
        &self,
        key: StoreKey,
        fingerprint: Fingerprint,
    ) -> Result<HttpBegin, EngineError>;
    fn begin_unkeyed(&self) -> Box<dyn HttpOwner>;
}

pub(crate) enum HttpBegin {
    Run(Box<dyn HttpOwner>),
    Replay(Bytes),
}

/// A [`TxOwner`] without its database type.
#[async_trait]
pub(crate) trait HttpOwner: Send {
    /// Puts the transaction into the request's extensions.
    fn lend(&self, extensions: &mut http::Extensions);
    async fn commit(self: Box<Self>, payload: Bytes) -> Result<(), CommitError>;
    async fn rollback(self: Box<Self>);
    /// Rolls back; `true` when the database had rolled the transaction back under the
    /// handler (see [`TxOwner::rollback_lost`]).
    async fn rollback_lost(self: Box<Self>) -> bool;
}

impl<DB: sqlx::Database> From<TxBegin<DB>> for HttpBegin {
    fn from(begin: TxBegin<DB>) -> Self {
        match begin {
            TxBegin::Run(owner) => HttpBegin::Run(Box::new(owner)),
            TxBegin::Replay(payload) => HttpBegin::Replay(payload),
        }
    }
}

#[async_trait]
impl<S: TransactionalStore> TxMode for Transactional<S> {
    async fn try_begin(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
    ) -> Result<Option<HttpBegin>, EngineError> {
        Ok(Transactional::try_begin(self, key, fingerprint)
            .await?
            .map(HttpBegin::from))
    }

    async fn wait_for(
        &self,
        key: StoreKey,
        fingerprint: Fingerprint,
    ) -> Result<HttpBegin, EngineError> {
        Transactional::wait_for(self, key, fingerprint)
            .await
            .map(HttpBegin::from)
    }

    fn begin_unkeyed(&self) -> Box<dyn HttpOwner> {
        Box::new(Transactional::begin_unkeyed(self))
    }
}

#[async_trait]
impl<DB: sqlx::Database> HttpOwner for TxOwner<DB> {
    fn lend(&self, extensions: &mut http::Extensions) {
        extensions.insert(self.transaction().clone());
    }

    async fn commit(self: Box<Self>, payload: Bytes) -> Result<(), CommitError> {
        TxOwner::commit(*self, payload).await
    }

    async fn rollback(self: Box<Self>) {
        TxOwner::rollback(*self).await
    }

    async fn rollback_lost(self: Box<Self>) -> bool {
        TxOwner::rollback_lost(*self).await
    }
}

pub(crate) type SharedTxMode = Arc<dyn TxMode>;
