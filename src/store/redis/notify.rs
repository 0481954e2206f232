//! Completion notifications on one Redis server: the fencing scripts `PUBLISH` the key's
//! digest when they complete or release it, and each store value (with its clones) keeps
//! one pub/sub connection subscribed once a waiter needs it.
//!
//! On a Redis Cluster the store does not notify: a classic `PUBLISH` is broadcast to every
//! node over the cluster bus, and sharded pub/sub would need a subscription per shard that
//! follows the slot map through failovers. Waiters there poll.

use std::sync::Arc;

use futures_util::StreamExt;

use crate::store::{keep_listening, CompletionSender, Completions, Feed, StoreError};

/// What a store that notifies keeps: where to subscribe, and the feed of its subscribers.
#[derive(Clone)]
pub(super) struct Notifier {
    client: redis::Client,
    channel: Arc<str>,
    feed: Arc<Feed>,
}

impl Notifier {
    /// Notifications on `prefix`'s channel, subscribed to with `client`.
    pub(super) fn new(client: redis::Client, prefix: &str) -> Self {
        Self {
            client,
            channel: format!("{prefix}settled").into(),
            feed: Arc::default(),
        }
    }

    /// The channel the scripts publish to.
    pub(super) fn channel(&self) -> &str {
        &self.channel
    }

    pub(super) fn subscribe(&self) -> Completions {
        let (client, channel) = (self.client.clone(), self.channel.clone());
        self.feed.subscribe(|sender| {
            keep_listening("redis", sender, move |sender| {
                listen(client.clone(), channel.clone(), sender)
            })
        })
    }
}

/// One subscribed session; `Err` only when it could not subscribe.
async fn listen(
    client: redis::Client,
    channel: Arc<str>,
    sender: CompletionSender,
) -> Result<(), StoreError> {
    let backend = |error| StoreError::backend("redis", error);
    let mut pubsub = client.get_async_pubsub().await.map_err(backend)?;
    pubsub.subscribe(&*channel).await.map_err(backend)?;
    sender.ready();
    let mut messages = pubsub.on_message();
    while let Some(message) = messages.next().await {
        sender.key(message.get_payload_bytes());
    }
    Ok(())
}
