//! Completion notifications: how a store that can push tells the waiters of every process
//! that a key was settled, instead of leaving them to poll.
//!
//! A store that supports it ([`Store::completions`](super::Store::completions)) keeps ONE
//! listening connection per process (per store value and its clones), started by the first
//! subscriber, and broadcasts what it hears to every subscriber. A notification is only a
//! hint to look now: it carries a digest of the key, never a record, and the waiters read the
//! store as usual. A notification that is lost (the listening connection dropped, a receiver
//! fell behind) becomes [`Completion::Missed`], and the waiters keep polling slowly
//! underneath, so correctness never depends on a notification arriving.

// The listening side serves the stores that can push (PostgreSQL, Redis); a build without
// them keeps only the public subscription types.
#![cfg_attr(not(any(feature = "postgres", feature = "redis")), allow(dead_code))]

use std::{future::Future, sync::OnceLock, time::Duration};

use tokio::{sync::broadcast, task::JoinHandle};

use super::StoreError;

/// One notification from a store's completion feed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Completion {
    /// The key whose [`StoreKey::digest`](crate::StoreKey::digest) this is was completed or
    /// released (in the transactional mode: committed).
    Key([u8; 32]),
    /// Notifications may have been lost (the listening connection was re-established, or
    /// this subscriber fell behind): every waiter should look again.
    Missed,
}

/// A subscription to a store's completion feed; see [`Store::completions`](super::Store::completions).
#[derive(Debug)]
pub struct Completions {
    receiver: broadcast::Receiver<Completion>,
}

impl Completions {
    /// The next notification, or `None` once the store (every clone of it) is gone.
    pub async fn next(&mut self) -> Option<Completion> {
        match self.receiver.recv().await {
            Ok(completion) => Some(completion),
            Err(broadcast::error::RecvError::Lagged(_)) => Some(Completion::Missed),
            Err(broadcast::error::RecvError::Closed) => None,
        }
    }
}

/// How many notifications a slow subscriber may fall behind before it is told
/// [`Completion::Missed`] instead.
const BACKLOG: usize = 4096;

/// A store's side of the feed: the broadcast, and the listening task, started once by the
/// first subscriber and stopped when the store is dropped.
pub(crate) struct Feed {
    sender: broadcast::Sender<Completion>,
    listener: OnceLock<AbortOnDrop>,
}

impl Default for Feed {
    fn default() -> Self {
        Self {
            sender: broadcast::Sender::new(BACKLOG),
            listener: OnceLock::new(),
        }
    }
}

impl Feed {
    /// Subscribes, starting the listener with `listen` if nobody did yet. Must run inside a
    /// Tokio runtime.
    pub(crate) fn subscribe<Fut>(&self, listen: impl FnOnce(Sender) -> Fut) -> Completions
    where
        Fut: Future<Output = ()> + Send + 'static,
    {
        let receiver = self.sender.subscribe();
        self.listener
            .get_or_init(|| AbortOnDrop(tokio::spawn(listen(Sender(self.sender.clone())))));
        Completions { receiver }
    }
}

/// What a listener hands its notifications to.
#[derive(Clone)]
pub(crate) struct Sender(broadcast::Sender<Completion>);

impl Sender {
    /// Passes a notification payload on; one that is not a key digest (sent by something
    /// else on the channel) is ignored.
    pub(crate) fn key(&self, payload: &[u8]) {
        if let Some(digest) = decode(payload) {
            // No subscriber right now is fine: nobody waits.
            let _ = self.0.send(Completion::Key(digest));
        }
    }

    /// Announces that the listener (re)subscribed: notifications sent before may be lost.
    pub(crate) fn ready(&self) {
        let _ = self.0.send(Completion::Missed);
    }
}

struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The payload that names `digest`: lowercase hex (64 bytes, far below every backend's limit).
#[cfg(any(feature = "postgres", test))]
pub(crate) fn encode(digest: &[u8; 32]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    digest
        .iter()
        .flat_map(|byte| [HEX[usize::from(byte >> 4)], HEX[usize::from(byte & 15)]])
        .map(char::from)
        .collect()
}

fn decode(payload: &[u8]) -> Option<[u8; 32]> {
    if payload.len() != 64 {
        return None;
    }
    let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut digest = [0; 32];
    for (byte, pair) in digest.iter_mut().zip(payload.chunks_exact(2)) {
        *byte = nibble(pair[0])? << 4 | nibble(pair[1])?;
    }
    Some(digest)
}

/// The pause before connecting again after a connection attempt failed.
const RECONNECT_AFTER: Duration = Duration::from_secs(1);
/// The pause before connecting again after a connection was lost: short, but never a busy
/// loop against a server that accepts and drops connections.
const RESUBSCRIBE_AFTER: Duration = Duration::from_millis(50);

/// Runs listening sessions forever. `session` connects and subscribes, calls `ready` once
/// its subscription is live, then passes notifications on until the connection is lost.
/// Every (re)connection is announced as [`Completion::Missed`], since whatever was sent while
/// nobody listened is gone.
pub(crate) async fn keep_listening<F, Fut>(backend: &'static str, sender: Sender, mut session: F)
where
    F: FnMut(Sender) -> Fut,
    Fut: Future<Output = Result<(), StoreError>>,
{
    loop {
        match session(sender.clone()).await {
            Ok(()) => {
                tracing::warn!(
                    backend,
                    "completion listener lost its connection; reconnecting"
                );
                tokio::time::sleep(RESUBSCRIBE_AFTER).await;
            }
            Err(error) => {
                tracing::warn!(backend, %error, "completion listener cannot connect; waiters poll meanwhile");
                tokio::time::sleep(RECONNECT_AFTER).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_round_trip_and_foreign_ones_are_ignored() {
        let digest = crate::StoreKey::new("s", "k").digest();
        assert_eq!(decode(encode(&digest).as_bytes()), Some(digest));
        assert_eq!(decode(b"hello"), None);
    }
}
