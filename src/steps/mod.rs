//! Recovery points: one keyed operation with several side effects, resumed where it stopped.
//!
//! The separate mode repeats a whole operation whose owner died between an effect and its
//! record; the transactional mode cannot put a call to another system inside a database
//! transaction. An operation made of **steps** closes that gap (the design of Stripe's
//! idempotency keys, "atomic phases" and "recovery points"):
//!
//! - a **local phase** (`Steps::local`, with a SQL feature) runs its writes in the store's database
//!   in ONE transaction with its journal entry (step name, serialised output), which commits
//!   only while the claim still holds its token;
//! - a **foreign call** ([`Steps::foreign`]) gets a key derived from the operation's scope, key
//!   and step name ([`KeyOwner::derive`]) to send downstream as its `Idempotency-Key`, and its
//!   output is journaled under the claim, fenced the same way;
//! - on a retry, or a takeover after the owner died or lost its lease, journaled steps hand
//!   back their outputs without running, and the operation continues from the first
//!   unfinished step. The final response is stored and replayed as for any keyed request.
//!
//! ```no_run
//! use bytes::Bytes;
//! use tower_idempotency::{steps::{PostgresJournal, StepError}, store::PostgresStore};
//! use tower_idempotency::{Engine, Fingerprint, StoreKey};
//!
//! # async fn charge_card(key: String, amount: i64) -> Result<String, std::io::Error> { Ok(key) }
//! # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let store = PostgresStore::new(pool);
//! let journal = PostgresJournal::for_store(&store);
//! let engine = Engine::new(store);
//! let key = StoreKey::new("alice", "order-7");
//! let outcome = engine
//!     .run_steps(journal, key, Fingerprint::of([b"order-7".as_slice()]), |steps| async move {
//!         let id: String = steps
//!             .local("record", |conn| Box::pin(async move {
//!                 sqlx::query("INSERT INTO orders (id) VALUES ('o7')").execute(&mut *conn).await?;
//!                 Ok::<_, sqlx::Error>("o7".to_owned())
//!             }))
//!             .await
//!             .map_err(|e| e.to_string())?;
//!         let charge: String = steps
//!             .foreign("charge", |derived_key| charge_card(derived_key, 1200))
//!             .await
//!             .map_err(|e: StepError<std::io::Error>| e.to_string())?;
//!         Ok::<_, String>(Bytes::from(format!("{id} {charge}")))
//!     })
//!     .await
//!     .map_err(|e| e.to_string())?;
//! # let _ = outcome; Ok(()) }
//! ```
//!
//! Behind the HTTP layer a handler finds the [`KeyOwner`] of its request in the request's
//! extensions and calls [`Steps::resume`] with it (`examples/payments/processor.rs`).
//!
//! # Journals
//!
//! | store | journal | steps |
//! |---|---|---|
//! | PostgreSQL | `PostgresJournal` (fence: `SELECT .. FOR SHARE` on the claim) | local phases and foreign calls |
//! | MySQL / MariaDB | `MySqlJournal` (fence: `SELECT .. LOCK IN SHARE MODE`) | local phases and foreign calls |
//! | SQLite | `SqliteJournal` (fence: `BEGIN IMMEDIATE`) | local phases and foreign calls |
//! | memory | `MemoryJournal` (under the key's lock) | foreign calls |
//! | Redis, one server or a cluster | `RedisJournal` (one Lua script, in the record's slot) | foreign calls |
//!
//! Each is behind its store's feature. `conformance::journal` (feature `conformance`) holds
//! a journal to the [`Journal`] contract; every journal here passes it.
//!
//! # Finishing without the client: the completer
//!
//! Opt in with a [`Completer`]: operations registered with it by name and run through
//! [`Completer::run`] journal their name and input first, so that when their owner dies the
//! completer's background task finds them ([`Journal::orphans`]: SQL and memory journals),
//! takes their key through the normal claim, resumes at the last recovery point and stores
//! the final response for the client's retry to replay.
//!
//! # Consumers
//!
//! [`Engine::run_steps`](crate::Engine::run_steps) is `run_once` with steps, for message
//! consumers too. The transactional mode's `Transactional::run_once` has no steps, by
//! design: its claim is an uncommitted row of the operation's one transaction, so nothing
//! can be journaled under it that would outlive a crash (the crash rolls the claim back with
//! everything else). A consumer whose effects are all in its database needs no steps there;
//! one that also calls elsewhere uses `run_steps` with the SQL journal, whose local phases
//! each commit their writes atomically, as the transactional mode does for the whole.
//!
//! # Which mode
//!
//! | the operation's effects | use |
//! |---|---|
//! | all in the store's database | the transactional mode: claim, writes and response commit together |
//! | in other systems too (a card processor, a mail service) | steps, in the separate mode |
//! | one call elsewhere, nothing local | the separate mode, with the key passed downstream |
//! | several calls elsewhere, nothing local (memory, Redis) | steps with foreign calls only |
//!
//! # What is guaranteed
//!
//! The token fence is the whole argument: a journal entry commits only while the claim holds
//! its token, atomically with that check (see [`Journal`]), and a new owner reads the journal
//! after it took the key. So:
//!
//! - a **local phase** takes effect exactly once: its writes commit with its entry, and a
//!   committed entry is never run again;
//! - a **foreign call** whose downstream honours idempotency keys takes effect once. If it
//!   does not honour them, the call is made at least once, and more than once only when an
//!   owner died (or lost its lease) between the call and its entry; never again once a later
//!   step was journaled;
//! - every attempt that reaches the end answers the same output (the journaled outputs are
//!   the same), and the first complete answer is replayed from then on.
//!
//! Entries are kept for the engine's retention from when they were written, belong to the
//! request fingerprint that wrote them, and outlive a released claim (a failed attempt's
//! finished steps are facts).
//!
//! # What a step must not do
//!
//! Everything that differs between attempts must come from a journaled output: a step must
//! not read the wall clock, generate random ids or read data that may change, and then use
//! it outside the step. Generate such values INSIDE a step (its output is journaled, so every
//! later attempt sees the same value), and give each step a fixed name and a fixed order.

mod completer;
mod error;
mod handle;
mod journal;
#[cfg(feature = "memory")]
mod memory;
#[cfg(feature = "mysql")]
mod mysql;
mod owner;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
mod run;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod sql;
#[cfg(feature = "sqlite")]
mod sqlite;

pub use completer::{Completer, UnknownOperation};
pub use error::StepError;
pub use handle::Steps;
pub use journal::{Journal, Orphan};
#[cfg(feature = "memory")]
pub use memory::MemoryJournal;
#[cfg(feature = "mysql")]
pub use mysql::MySqlJournal;
pub use owner::KeyOwner;
#[cfg(feature = "postgres")]
pub use postgres::PostgresJournal;
#[cfg(feature = "redis")]
pub use redis::RedisJournal;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub use sql::{JournalDatabase, SqlJournal, DEFAULT_TABLE};
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteJournal;
