//! The owner's open transaction: sqlx's own, or one this crate began itself.

use std::ops::{Deref, DerefMut};

use sqlx::{pool::PoolConnection, Database, Transaction};

/// An open transaction of the transactional mode, on one pooled connection. It dereferences
/// to that connection, so it is an executor for sqlx (`.execute(&mut *tx)`).
///
/// On SQLite it is a sqlx [`Transaction`]. On PostgreSQL the crate sends `BEGIN`, `COMMIT`
/// and `ROLLBACK` itself, so that it can claim the key in the `BEGIN`'s round trip and store
/// the outcome in the `COMMIT`'s (see the `postgres` dialect), which sqlx's transaction cannot
/// do without depending on how it works inside. A consequence on PostgreSQL: sqlx does not
/// know the connection is in a transaction, so a handler that wants a nested unit of work
/// sends `SAVEPOINT` / `RELEASE SAVEPOINT` / `ROLLBACK TO SAVEPOINT` itself and must not call
/// sqlx's `begin()` on it (that would send a second `BEGIN`, and its `commit()` would end the
/// layer's transaction early). On MySQL/MariaDB the crate holds the connection too (its
/// session runs with `autocommit` off while it owns a key, which must not reach the pool), but
/// begins through sqlx's transaction manager, so there sqlx's `begin()` does make a savepoint.
///
/// Dropped while still open (a cancelled request, a handler that kept the transaction), it
/// never goes back to the pool inside the transaction: sqlx's rolls back on its next use, and
/// a crate-owned one is closed, which the server rolls back.
pub struct OpenTx<DB: Database>(State<DB>);

enum State<DB: Database> {
    Sqlx(Transaction<'static, DB>),
    Own(PoolConnection<DB>),
    /// Handed back by [`OpenTx::into_sqlx`] or [`OpenTx::into_connection`].
    Ended,
}

impl<DB: Database> OpenTx<DB> {
    /// A transaction begun by sqlx.
    pub fn from_sqlx(tx: Transaction<'static, DB>) -> Self {
        Self(State::Sqlx(tx))
    }

    /// A connection on which this crate is about to send `BEGIN` (or has sent it). Wrapped
    /// before the `BEGIN` goes out, so that a cancellation in between closes the connection
    /// instead of handing it back to the pool mid-transaction.
    pub fn own(connection: PoolConnection<DB>) -> Self {
        Self(State::Own(connection))
    }

    /// sqlx's transaction, to commit or roll back with sqlx; `None` for a crate-owned one.
    pub fn into_sqlx(mut self) -> Option<Transaction<'static, DB>> {
        match std::mem::replace(&mut self.0, State::Ended) {
            State::Sqlx(tx) => Some(tx),
            other => {
                self.0 = other;
                None
            }
        }
    }

    /// A crate-owned transaction's connection, once the crate has sent its `COMMIT` or
    /// `ROLLBACK` (it goes back to the pool when dropped); `None` for sqlx's.
    pub fn into_connection(mut self) -> Option<PoolConnection<DB>> {
        match std::mem::replace(&mut self.0, State::Ended) {
            State::Own(connection) => Some(connection),
            other => {
                self.0 = other;
                None
            }
        }
    }
}

impl<DB: Database> Deref for OpenTx<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        match &self.0 {
            State::Sqlx(tx) => tx,
            State::Own(connection) => connection,
            // Both `into_*` consume the value: nobody can look at an ended one.
            State::Ended => unreachable!("an OpenTx is used after it ended"),
        }
    }
}

impl<DB: Database> DerefMut for OpenTx<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        match &mut self.0 {
            State::Sqlx(tx) => tx,
            State::Own(connection) => connection,
            State::Ended => unreachable!("an OpenTx is used after it ended"),
        }
    }
}

impl<DB: Database> Drop for OpenTx<DB> {
    fn drop(&mut self) {
        if let State::Own(connection) = &mut self.0 {
            // Still open: the server rolls back when the connection closes.
            connection.close_on_drop();
        }
    }
}

impl<DB: Database> std::fmt::Debug for OpenTx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.0 {
            State::Sqlx(_) => "sqlx",
            State::Own(_) => "own",
            State::Ended => "ended",
        };
        f.debug_tuple("OpenTx").field(&kind).finish()
    }
}
