//! Turns at a database with one writer at a time (SQLite).
//!
//! There, every owner's transaction holds the database's write lock while its operation
//! runs, so owners of different keys run one after another. Left to the database, each
//! waiting owner would hold a pooled connection in its busy wait (starving the reads that
//! duplicates and other requests need), be served in no particular order, and give up after
//! the busy timeout as if the store were down. Here the owners of one process queue first
//! come, first served, without a connection, for as long as their request may wait; only the
//! head of the queue waits in the database (for another process' writer).

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The queue of this process' writers at one database. Clones share it.
#[derive(Debug, Clone)]
pub struct WriterQueue(Arc<Semaphore>);

impl Default for WriterQueue {
    fn default() -> Self {
        Self(Arc::new(Semaphore::new(1)))
    }
}

impl WriterQueue {
    /// Waits for this caller's turn to write, behind every caller that asked before it.
    pub(crate) async fn turn(&self) -> WriterTurn {
        // The semaphore is never closed, so acquiring cannot fail; were it ever closed, a
        // turn without a permit only loses the ordering, not correctness.
        WriterTurn {
            _permit: self.0.clone().acquire_owned().await.ok(),
        }
    }
}

/// This caller's turn to write; the next caller's begins when it is dropped (after the
/// transaction ended).
#[derive(Debug)]
pub struct WriterTurn {
    _permit: Option<OwnedSemaphorePermit>,
}
