//! [`Completer`]: finishes operations whose owner died, without waiting for the client.

use std::{collections::HashMap, future::Future, sync::Arc, time::Duration};

use bytes::Bytes;
use futures_util::future::BoxFuture;

use super::{Journal, KeyOwner, Steps};
use crate::{
    engine::{Begin, Claim, Engine, Execution, RunError},
    record::{Fingerprint, StoreKey},
    store::StoreError,
    BoxError,
};

/// The entry that names an operation and holds its input: the first of every operation run
/// through a completer. Names starting with `@` are the completer's.
const STARTED: &str = "@operation";
/// The entry of an operation that failed by itself (its code returned an error): its owner
/// did not die, so the completer leaves it to the client's retry.
const FAILED: &str = "@failed";

type Operation<J> =
    Arc<dyn Fn(Steps<J>, Bytes) -> BoxFuture<'static, Result<Bytes, BoxError>> + Send + Sync>;

/// Finishes keyed operations whose owner died (opt-in): an operation run through
/// [`Completer::run`] journals its name and input first; when its owner dies before it
/// answered (a crash, a dropped request), [`Completer::complete_orphans`] (or the task of
/// [`Completer::spawn`]) finds it in the journal, takes the key through the normal claim,
/// resumes from the last recovery point with the code registered under that name, and
/// stores the final response, which the client's retry then replays.
///
/// An operation that fails by itself (its code returns an error) is not an orphan: the
/// completer leaves it to the client's retry. Orphans are found through
/// [`Journal::orphans`]: on the SQL and memory journals, not on Redis. A pass reads the live
/// `@operation` entries of the journal (through an index on the step), those of finished
/// operations too until they expire: run passes seconds apart, not in a tight loop.
///
/// Only operations run through [`Completer::run`] can be completed: the completer needs
/// their code (registered by name) and their input (journaled). A handler behind the HTTP
/// layer that uses [`Steps::resume`] directly resumes on the client's retry only.
///
/// ```no_run
/// use bytes::Bytes;
/// use tower_idempotency::{steps::{Completer, PostgresJournal}, store::PostgresStore};
/// use tower_idempotency::{Engine, Fingerprint, StoreKey};
///
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::new(pool);
/// let journal = PostgresJournal::for_store(&store);
/// let completer = Completer::new(Engine::new(store), journal).operation("pay", |steps, input| async move {
///     let charge: String = steps
///         .foreign("charge", |key| async move { Ok::<_, std::io::Error>(key) })
///         .await?;
///     Ok::<_, tower_idempotency::BoxError>(Bytes::from(format!("{charge} for {input:?}")))
/// });
/// let _task = completer.clone().spawn(std::time::Duration::from_secs(5));
/// let key = StoreKey::new("alice", "order-7");
/// let outcome = completer.run(key, Fingerprint::of([b"12".as_slice()]), "pay", Bytes::from("12")).await;
/// let answer = outcome.map_err(|e| e.to_string())?;
/// # Ok(()) }
/// ```
pub struct Completer<J> {
    engine: Engine,
    journal: J,
    operations: HashMap<String, Operation<J>>,
}

impl<J> Clone for Completer<J>
where
    J: Clone,
{
    fn clone(&self) -> Self {
        Self {
            engine: self.engine.clone(),
            journal: self.journal.clone(),
            operations: self.operations.clone(),
        }
    }
}

impl<J> std::fmt::Debug for Completer<J> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completer")
            .field("operations", &self.operations.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// No operation is registered under the name an operation was run or journaled with.
#[derive(Debug, thiserror::Error)]
#[error("no operation {name:?} is registered with the completer; register it with `Completer::operation` in every process that runs or completes it")]
pub struct UnknownOperation {
    /// The name.
    pub name: String,
}

impl<J: Journal + Clone> Completer<J> {
    /// A completer of operations claimed through `engine` and journaled in `journal`, with
    /// no operation registered yet.
    pub fn new(engine: Engine, journal: J) -> Self {
        Self {
            engine,
            journal,
            operations: HashMap::new(),
        }
    }

    /// Registers `operation`'s code under `name`. Every process that runs or completes it
    /// registers the same code under the same name; the code gets the operation's steps and
    /// its input, and must follow the rules of steps (see the module docs).
    ///
    /// # Panics
    ///
    /// On a name that is empty or contains a NUL byte (the journal's separator).
    pub fn operation<F, Fut, E>(mut self, name: &str, operation: F) -> Self
    where
        F: Fn(Steps<J>, Bytes) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Bytes, E>> + Send + 'static,
        E: Into<BoxError>,
    {
        assert!(
            !name.is_empty() && !name.contains('\0'),
            "an operation name is non-empty and has no NUL byte"
        );
        let operation: Operation<J> = Arc::new(move |steps, input| {
            let run = operation(steps, input);
            Box::pin(async move { run.await.map_err(Into::into) })
        });
        self.operations.insert(name.to_owned(), operation);
        self
    }

    /// Runs operation `name` with `input` under `key`, as [`Engine::run_steps`] does, after
    /// journaling its name and input so that a completer can finish it should this process
    /// die. A retry gets the recorded output, or resumes where the last attempt stopped.
    pub async fn run(
        &self,
        key: StoreKey,
        fingerprint: Fingerprint,
        name: &str,
        input: Bytes,
    ) -> Result<Execution, RunError<BoxError>> {
        let claim = match self.engine.begin(key, fingerprint).await? {
            Begin::Replay(output) => return Ok(Execution::Replayed(output)),
            Begin::Run(claim) => claim,
        };
        self.drive(claim, Some((name, input))).await
    }

    /// One pass: finishes up to `limit` operations whose owner died, each through the normal
    /// claim (an operation a client retry is running meanwhile is waited for, not run twice).
    /// Returns how many this pass ran to their end. An orphan whose code fails is released
    /// and marked failed, and left to the client's retry.
    pub async fn complete_orphans(&self, limit: u32) -> Result<usize, StoreError> {
        let mut finished = 0;
        for orphan in self.journal.orphans(STARTED, FAILED, limit).await? {
            let key = orphan.key;
            let claim = match self.engine.begin(key.clone(), orphan.fingerprint).await {
                Ok(Begin::Run(claim)) => claim,
                // Finished meanwhile (a client's retry, another completer).
                Ok(Begin::Replay(_)) => continue,
                Err(error) => {
                    tracing::warn!(key = %key.log_id(), %error, "completer could not claim an orphaned operation");
                    continue;
                }
            };
            match self.drive(claim, None).await {
                Ok(_) => finished += 1,
                Err(error) => {
                    tracing::warn!(key = %key.log_id(), %error, "completer could not finish an orphaned operation");
                }
            }
        }
        Ok(finished)
    }

    /// Runs [`complete_orphans`](Self::complete_orphans) (100 at a time) every `every`, on a
    /// task of the current tokio runtime, until the returned handle is aborted (dropping it
    /// does not stop the task) or the runtime shuts down. A failing pass is logged and the
    /// next one tries again.
    pub fn spawn(self, every: Duration) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            loop {
                if let Err(error) = self.complete_orphans(100).await {
                    tracing::warn!(%error, "completer pass failed");
                }
                tokio::time::sleep(every).await;
            }
        })
    }

    /// Runs the operation of `claim` to its end: the journaled name and input (a resumed
    /// operation), else `start`'s, journaled first.
    async fn drive(
        &self,
        claim: Claim,
        start: Option<(&str, Bytes)>,
    ) -> Result<Execution, RunError<BoxError>> {
        let key = claim.key().clone();
        let steps = match Steps::resume(self.journal.clone(), KeyOwner::of(&claim)).await {
            Ok(steps) => steps,
            Err(source) => {
                let _ = claim.release().await;
                return Err(RunError::Engine(self.engine.unavailable(&key, source)));
            }
        };
        let journaled = steps.raw(STARTED);
        let (name, input) = match (&journaled, start) {
            (Some(entry), _) => decode(entry),
            (None, Some((name, input))) => (name.to_owned(), input),
            // Its entry expired between the completer's search and its claim.
            (None, None) => {
                let _ = claim.release().await;
                return Err(RunError::Operation(
                    "the operation's journal expired before the completer took its key".into(),
                ));
            }
        };
        // Checked before the entry is written: an unknown name must leave no orphan behind.
        let Some(operation) = self.operations.get(&name) else {
            let _ = claim.release().await;
            return Err(RunError::Operation(Box::new(UnknownOperation { name })));
        };
        if journaled.is_none() {
            let entry = encode(&name, &input);
            if let Err(source) = self
                .journal
                .append(steps.owner(), STARTED, entry.clone())
                .await
            {
                let _ = claim.release().await;
                return Err(RunError::Engine(self.engine.unavailable(&key, source)));
            }
            steps.remember(STARTED, entry);
        }
        let result = claim.run(operation(steps.clone(), input)).await;
        if result.is_err() {
            // Failed by itself: not the completer's to retry.
            let _ = self
                .journal
                .append(steps.owner(), FAILED, Bytes::new())
                .await;
        }
        Engine::settle(claim, result).await
    }
}

/// The `@operation` entry: the name, a NUL, the input.
fn encode(name: &str, input: &Bytes) -> Bytes {
    [name.as_bytes(), b"\0", input].concat().into()
}

fn decode(entry: &Bytes) -> (String, Bytes) {
    match entry.iter().position(|&b| b == 0) {
        Some(at) => (
            String::from_utf8_lossy(&entry[..at]).into_owned(),
            entry.slice(at + 1..),
        ),
        None => (String::from_utf8_lossy(entry).into_owned(), Bytes::new()),
    }
}
