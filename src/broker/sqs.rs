//! Amazon SQS through `aws-sdk-sqs` (feature `sqs`), standard and FIFO queues.
//!
//! You build the [`Client`] (credentials, region, endpoint: the SDK's own configuration
//! chain, or an endpoint override for a local SQS) and hand it over; this module adds no HTTP
//! stack or credential chain of its own.
//!
//! Topology ([`SqsTopology::declare`], idempotent): a queue (e.g. `receipts`, or
//! `receipts.fifo`) and its dead-letter queue (`receipts-dead`, `receipts-dead.fifo`), with a
//! redrive policy whose `maxReceiveCount` is a high backstop only (see the [broker
//! contract](super)): the consumer dead-letters poison itself, by sending it to the
//! dead-letter queue and then deleting it.
//!
//! Publishing ([`SqsPublisher`]): `SendMessageBatch` in batches of ten, the message id as the
//! message attribute [`ID_ATTRIBUTE`], one [`Verdict`] per entry. On a FIFO queue the
//! ordering key is the `MessageGroupId` and the message id the `MessageDeduplicationId`, so
//! SQS itself drops a re-publish within its five-minute deduplication interval.
//!
//! Consuming ([`SqsSubscriber`]): long-polling `ReceiveMessage`; an ack deletes the message
//! with the receipt handle of this receive (after the inbox commit: a delete that fails or
//! comes late is harmless, the copy comes back and is a duplicate). While a delivery is held,
//! the [inbox consumer](crate::inbox::Consumer) extends its visibility
//! ([`keep_alive`](Delivery::keep_alive), `ChangeMessageVisibility`) every third of the
//! visibility timeout, so a slow handler or a database outage does not hand the message to
//! another consumer nor raise its receive count. `ApproximateReceiveCount` is the delivery
//! count.

use std::{collections::VecDeque, sync::Arc, time::Duration};

use async_trait::async_trait;
use aws_sdk_sqs::{
    error::ProvideErrorMetadata,
    types::{
        MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
        SendMessageBatchRequestEntry,
    },
    Client,
};

use super::{
    deadline, Backoff, BrokerError, Delivery, OutgoingMessage, Publisher, Refusal, Subscriber,
    Verdict, DEFAULT_CALL_TIMEOUT,
};

/// The client library, for what this module does not wrap (building the client, deleting a
/// test's queues).
pub use aws_sdk_sqs;

const BROKER: &str = "sqs";

/// The message attribute that carries the outbox event id.
pub const ID_ATTRIBUTE: &str = "message_id";

/// The message attribute that carries the message's topic (e.g. `payment.created`).
pub const TOPIC_ATTRIBUTE: &str = "topic";

/// The message attribute a dead letter carries: why it was dead-lettered.
pub const REASON_ATTRIBUTE: &str = "dead_letter_reason";

/// The most entries one `SendMessageBatch` takes.
const MAX_BATCH: usize = 10;

/// Error codes after which retrying cannot help: the queue is gone, exists with other
/// attributes, or access is refused.
const PERMANENT_CODES: &[&str] = &[
    "QueueAlreadyExists",
    "QueueNameExists",
    "AWS.SimpleQueueService.QueueNameExists",
    "AWS.SimpleQueueService.NonExistentQueue",
    "QueueDoesNotExist",
    "AccessDenied",
    "AccessDeniedException",
    "InvalidClientTokenId",
    "UnrecognizedClientException",
];

/// A queue and its dead-letter queue. See the [module docs](self).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqsTopology {
    /// The queue name; a FIFO queue's ends in `.fifo`.
    pub queue: String,
    /// How long a received message stays invisible to other consumers (the queue's
    /// `VisibilityTimeout`); the consumer extends it while it holds a delivery.
    pub visibility_timeout: Duration,
    /// Receives of one message before SQS moves it to the dead-letter queue by itself (the
    /// redrive policy's `maxReceiveCount`), a backstop against a message that kills its
    /// consumer every time.
    pub max_receive_count: u32,
}

/// The URLs [`SqsTopology::declare`] found or created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqsQueues {
    /// The queue's URL: publish to it, consume from it.
    pub queue_url: String,
    /// The dead-letter queue's URL.
    pub dead_letter_url: String,
}

impl SqsTopology {
    /// Queue `queue` (FIFO if its name ends in `.fifo`), visibility timeout 30 s, redrive
    /// after 20 receives: above the [inbox consumer](crate::inbox::Consumer)'s
    /// `max_attempts`, since an outage or a killed consumer also counts as a receive.
    pub fn new(queue: impl Into<String>) -> Self {
        Self {
            queue: queue.into(),
            visibility_timeout: Duration::from_secs(30),
            max_receive_count: 20,
        }
    }

    /// Whether the queue is a FIFO queue (its name ends in `.fifo`).
    pub fn is_fifo(&self) -> bool {
        self.queue.ends_with(".fifo")
    }

    /// The dead-letter queue's name: `<queue>-dead`, or `<queue>-dead.fifo` for a FIFO queue
    /// (SQS requires a FIFO queue's dead letters to go to a FIFO queue).
    pub fn dead_letter_queue(&self) -> String {
        match self.queue.strip_suffix(".fifo") {
            Some(base) => format!("{base}-dead.fifo"),
            None => format!("{}-dead", self.queue),
        }
    }

    /// Creates both queues if they do not exist (an existing queue with other attributes is
    /// a [`BrokerError::Misconfigured`]) and returns their URLs. Each call is limited to
    /// [`DEFAULT_CALL_TIMEOUT`].
    pub async fn declare(&self, client: &Client) -> Result<SqsQueues, BrokerError> {
        let dead_letter_url = self.create(client, &self.dead_letter_queue(), None).await?;
        let action = "read the dead-letter queue's ARN";
        let request = client
            .get_queue_attributes()
            .queue_url(&dead_letter_url)
            .attribute_names(QueueAttributeName::QueueArn)
            .send();
        let arn = call(action, DEFAULT_CALL_TIMEOUT, request)
            .await?
            .attributes
            .and_then(|mut attributes| attributes.remove(&QueueAttributeName::QueueArn))
            .ok_or_else(|| BrokerError::broker(BROKER, action, "no QueueArn"))?;
        let redrive = serde_json::json!({
            "deadLetterTargetArn": arn,
            "maxReceiveCount": self.max_receive_count,
        })
        .to_string();
        let queue_url = self.create(client, &self.queue, Some(redrive)).await?;
        Ok(SqsQueues {
            queue_url,
            dead_letter_url,
        })
    }

    async fn create(
        &self,
        client: &Client,
        name: &str,
        redrive: Option<String>,
    ) -> Result<String, BrokerError> {
        let mut request = client.create_queue().queue_name(name).attributes(
            QueueAttributeName::VisibilityTimeout,
            self.visibility_timeout.as_secs().to_string(),
        );
        if self.is_fifo() {
            request = request.attributes(QueueAttributeName::FifoQueue, "true");
        }
        if let Some(redrive) = redrive {
            request = request.attributes(QueueAttributeName::RedrivePolicy, redrive);
        }
        let answer = call("declare the queues", DEFAULT_CALL_TIMEOUT, request.send()).await?;
        answer.queue_url.ok_or_else(|| {
            BrokerError::broker(BROKER, "declare the queues", "CreateQueue returned no URL")
        })
    }
}

/// A transient [`BrokerError::Broker`], or [`BrokerError::Misconfigured`] for an error code
/// after which retrying cannot help.
fn classify<E>(action: &'static str, error: E) -> BrokerError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let permanent = error
        .code()
        .is_some_and(|code| PERMANENT_CODES.contains(&code));
    BrokerError::failed(BROKER, action, permanent, error)
}

/// Runs an SDK call under the time limit `limit`, its error [classified](classify).
async fn call<T, E>(
    action: &'static str,
    limit: Duration,
    request: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, BrokerError>
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    deadline(BROKER, action, limit, async {
        request.await.map_err(|e| classify(action, e))
    })
    .await
}

fn string_attribute(value: &str) -> Result<MessageAttributeValue, BrokerError> {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .map_err(|e| BrokerError::broker(BROKER, "build a message attribute", e))
}

/// Publishes to one queue with `SendMessageBatch`. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct SqsPublisher {
    client: Client,
    queue_url: String,
    fifo: bool,
    timeout: Duration,
}

impl SqsPublisher {
    /// Publishes to the queue at `queue_url` (FIFO if the URL ends in `.fifo`).
    pub fn new(client: Client, queue_url: impl Into<String>) -> Self {
        let queue_url = queue_url.into();
        Self {
            fifo: queue_url.ends_with(".fifo"),
            client,
            queue_url,
            timeout: DEFAULT_CALL_TIMEOUT,
        }
    }

    /// The time limit of one call to [`publish_confirmed`](Publisher::publish_confirmed),
    /// all its batches together (default [`DEFAULT_CALL_TIMEOUT`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn entry(&self, index: usize, message: &OutgoingMessage) -> Result<Entry, BrokerError> {
        let Ok(body) = std::str::from_utf8(&message.payload) else {
            return Ok(Entry::Refused(Refusal::new(
                BROKER,
                "an SQS message body must be text; this one is not UTF-8",
            )));
        };
        let mut entry = SendMessageBatchRequestEntry::builder()
            .id(index.to_string())
            .message_body(body)
            .message_attributes(ID_ATTRIBUTE, string_attribute(&message.id)?)
            .message_attributes(TOPIC_ATTRIBUTE, string_attribute(&message.topic)?);
        if self.fifo {
            // Without a key no order is promised: one group per message keeps them apart.
            let group = message.key.as_deref().unwrap_or(&message.id);
            entry = entry
                .message_group_id(group)
                .message_deduplication_id(&message.id);
        }
        entry
            .build()
            .map(Entry::Send)
            .map_err(|e| BrokerError::broker(BROKER, "build a batch entry", e))
    }

    async fn publish_all(&self, messages: &[OutgoingMessage]) -> Result<Vec<Verdict>, BrokerError> {
        let mut verdicts = Vec::with_capacity(messages.len());
        for chunk in messages.chunks(MAX_BATCH) {
            verdicts.extend(self.publish_batch(chunk).await?);
        }
        Ok(verdicts)
    }

    async fn publish_batch(&self, chunk: &[OutgoingMessage]) -> Result<Vec<Verdict>, BrokerError> {
        let mut verdicts: Vec<Option<Verdict>> = vec![None; chunk.len()];
        let mut entries = Vec::with_capacity(chunk.len());
        for (index, message) in chunk.iter().enumerate() {
            match self.entry(index, message)? {
                Entry::Send(entry) => entries.push(entry),
                Entry::Refused(refusal) => verdicts[index] = Some(Err(refusal)),
            }
        }
        if !entries.is_empty() {
            let request = self
                .client
                .send_message_batch()
                .queue_url(&self.queue_url)
                .set_entries(Some(entries))
                .send();
            // The batch's time limit is the caller's, around every chunk.
            let answer = request.await.map_err(|e| classify("publish", e))?;
            for sent in answer.successful() {
                if let Some(slot) = slot(&mut verdicts, sent.id()) {
                    *slot = Some(Ok(()));
                }
            }
            for failed in answer.failed() {
                // SQS's own failure says nothing about the message: the whole batch is
                // published again later, and consumers (or FIFO deduplication) drop copies.
                if !failed.sender_fault() {
                    return Err(BrokerError::broker(
                        BROKER,
                        "publish",
                        format!("{}: {}", failed.code(), failed.message().unwrap_or("")),
                    ));
                }
                if let Some(slot) = slot(&mut verdicts, failed.id()) {
                    *slot = Some(Err(Refusal::new(
                        BROKER,
                        format!("{}: {}", failed.code(), failed.message().unwrap_or("")),
                    )));
                }
            }
        }
        verdicts
            .into_iter()
            .map(|verdict| {
                verdict.ok_or_else(|| {
                    BrokerError::broker(BROKER, "publish", "SQS left a batch entry unanswered")
                })
            })
            .collect()
    }
}

enum Entry {
    Send(SendMessageBatchRequestEntry),
    Refused(Refusal),
}

fn slot<'a>(verdicts: &'a mut [Option<Verdict>], id: &str) -> Option<&'a mut Option<Verdict>> {
    id.parse::<usize>().ok().and_then(|i| verdicts.get_mut(i))
}

#[async_trait]
impl Publisher for SqsPublisher {
    async fn publish_confirmed(
        &self,
        messages: &[OutgoingMessage],
    ) -> Result<Vec<Verdict>, BrokerError> {
        deadline(BROKER, "publish", self.timeout, self.publish_all(messages)).await
    }
}

/// Receives from one queue with long polling. See the [module docs](self).
pub struct SqsSubscriber {
    shared: Arc<Shared>,
    batch: i32,
    wait: Duration,
    heartbeat: bool,
    received: VecDeque<SqsDelivery>,
    backoff: Backoff,
}

/// What a subscriber's deliveries share.
#[derive(Debug)]
struct Shared {
    client: Client,
    queue_url: String,
    dead_letter_url: String,
    fifo: bool,
    visibility: Duration,
    timeout: Duration,
}

impl SqsSubscriber {
    /// Receives from `queues.queue_url`, dead-letters to `queues.dead_letter_url`. Reads
    /// the queue's visibility timeout (a queue that does not exist is
    /// [`BrokerError::Misconfigured`]). Defaults: up to 10 messages per receive, 20 s long
    /// polls, heartbeat on.
    pub async fn connect(client: Client, queues: &SqsQueues) -> Result<Self, BrokerError> {
        let action = "read the queue's visibility timeout";
        let request = client
            .get_queue_attributes()
            .queue_url(&queues.queue_url)
            .attribute_names(QueueAttributeName::VisibilityTimeout)
            .send();
        let visibility = call(action, DEFAULT_CALL_TIMEOUT, request)
            .await?
            .attributes
            .and_then(|attributes| {
                attributes
                    .get(&QueueAttributeName::VisibilityTimeout)
                    .and_then(|seconds| seconds.parse().ok())
            })
            .map(Duration::from_secs)
            .ok_or_else(|| BrokerError::broker(BROKER, action, "no VisibilityTimeout"))?;
        Ok(Self {
            shared: Arc::new(Shared {
                fifo: queues.queue_url.ends_with(".fifo"),
                client,
                queue_url: queues.queue_url.clone(),
                dead_letter_url: queues.dead_letter_url.clone(),
                visibility,
                timeout: DEFAULT_CALL_TIMEOUT,
            }),
            batch: MAX_BATCH as i32,
            wait: Duration::from_secs(20),
            heartbeat: true,
            received: VecDeque::new(),
            backoff: Backoff::default(),
        })
    }

    /// Messages taken per receive, 1 to 10 (default 10). Received messages wait in the
    /// subscriber until [`next`](Subscriber::next) hands them out, and their visibility
    /// timeout runs meanwhile: keep the batch at most the consumer's concurrency when
    /// handlers take a good part of the timeout.
    pub fn batch(mut self, batch: u8) -> Self {
        self.batch = i32::from(batch.clamp(1, MAX_BATCH as u8));
        self
    }

    /// How long one receive waits for a message (long polling; default 20 s, at most 20 s).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait.min(Duration::from_secs(20));
        self
    }

    /// Whether deliveries ask to be kept alive (default on): their
    /// [`keep_alive_every`](Delivery::keep_alive_every) is a third of the visibility timeout,
    /// and the [inbox consumer](crate::inbox::Consumer) extends the visibility that often
    /// while it works. Off, it is `None`: a handler slower than the visibility timeout sees
    /// its message delivered again to another consumer while it works (the inbox keeps the
    /// effect single, at the cost of the second delivery).
    pub fn heartbeat(mut self, on: bool) -> Self {
        self.heartbeat = on;
        self
    }

    async fn receive(&mut self) -> Result<(), BrokerError> {
        let shared = &self.shared;
        let receive = shared
            .client
            .receive_message()
            .queue_url(&shared.queue_url)
            .max_number_of_messages(self.batch)
            .wait_time_seconds(self.wait.as_secs() as i32)
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
            .message_attribute_names("All")
            .send();
        let answer = call("receive", self.wait + shared.timeout, receive).await?;
        for message in answer.messages.unwrap_or_default() {
            let Some(receipt) = message.receipt_handle.clone() else {
                continue;
            };
            self.received.push_back(SqsDelivery {
                shared: self.shared.clone(),
                receipt,
                message,
                heartbeat: self.heartbeat,
            });
        }
        Ok(())
    }
}

#[async_trait]
impl Subscriber for SqsSubscriber {
    type Delivery = SqsDelivery;

    async fn next(&mut self) -> Result<SqsDelivery, BrokerError> {
        loop {
            if let Some(delivery) = self.received.pop_front() {
                return Ok(delivery);
            }
            match self.receive().await {
                Ok(()) => self.backoff.reset(),
                Err(error) if error.is_permanent() => return Err(error),
                Err(error) => {
                    tracing::warn!(error = %super::error_chain(&error), "sqs: receiving failed; retrying");
                    self.backoff.wait().await;
                }
            }
        }
    }

    async fn close(self) {
        // Messages received but never handed out become visible again after the timeout;
        // giving them back now saves that wait.
        for delivery in self.received {
            let _ = delivery.change_visibility(Duration::ZERO).await;
        }
    }
}

async fn extend(shared: &Shared, receipt: &str, by: Duration) -> Result<(), BrokerError> {
    let change = shared
        .client
        .change_message_visibility()
        .queue_url(&shared.queue_url)
        .receipt_handle(receipt)
        // SQS takes whole seconds, at most 12 hours.
        .visibility_timeout(by.as_secs().min(12 * 3600) as i32)
        .send();
    call("change the visibility", shared.timeout, change)
        .await
        .map(drop)
}

/// An SQS delivery: the message and the receipt handle of this receive.
pub struct SqsDelivery {
    shared: Arc<Shared>,
    receipt: String,
    message: aws_sdk_sqs::types::Message,
    heartbeat: bool,
}

impl SqsDelivery {
    async fn change_visibility(&self, to: Duration) -> Result<(), BrokerError> {
        extend(&self.shared, &self.receipt, to).await
    }

    async fn delete(&self) -> Result<(), BrokerError> {
        let delete = self
            .shared
            .client
            .delete_message()
            .queue_url(&self.shared.queue_url)
            .receipt_handle(&self.receipt)
            .send();
        call("delete", self.shared.timeout, delete).await.map(drop)
    }

    fn attribute(&self, name: &str) -> Option<&str> {
        self.message
            .message_attributes
            .as_ref()?
            .get(name)?
            .string_value
            .as_deref()
    }

    async fn send_to_dead_letter_queue(&self, reason: &str) -> Result<(), BrokerError> {
        let shared = &self.shared;
        let mut send = shared
            .client
            .send_message()
            .queue_url(&shared.dead_letter_url)
            .message_body(self.message.body.clone().unwrap_or_default())
            // SQS caps an attribute at 256 KiB with the body; a reason is a log line.
            .message_attributes(REASON_ATTRIBUTE, string_attribute(&truncate(reason, 1024))?);
        for (name, value) in self.message.message_attributes.iter().flatten() {
            if name != REASON_ATTRIBUTE {
                send = send.message_attributes(name, value.clone());
            }
        }
        if shared.fifo {
            let id = self.message_id().or(self.message.message_id.as_deref());
            let group = self
                .message
                .attributes
                .as_ref()
                .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
                .map(String::as_str)
                .or(id)
                .unwrap_or("dead-letter");
            send = send
                .message_group_id(group)
                .message_deduplication_id(id.unwrap_or(&self.receipt));
        }
        call("send to the dead-letter queue", shared.timeout, send.send())
            .await
            .map(drop)
    }
}

fn truncate(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((end, _)) => text[..end].to_owned(),
        None => text.to_owned(),
    }
}

#[async_trait]
impl Delivery for SqsDelivery {
    fn message_id(&self) -> Option<&str> {
        self.attribute(ID_ATTRIBUTE)
    }

    fn payload(&self) -> &[u8] {
        self.message.body.as_deref().unwrap_or_default().as_bytes()
    }

    fn delivery_count(&self) -> u32 {
        self.message
            .attributes
            .as_ref()
            .and_then(|a| a.get(&MessageSystemAttributeName::ApproximateReceiveCount))
            .and_then(|count| count.parse().ok())
            // Unknown: not provably the first.
            .unwrap_or(2)
    }

    async fn ack(&self) -> Result<(), BrokerError> {
        self.delete().await
    }

    async fn retry(&self, delay: Duration) -> Result<(), BrokerError> {
        // Visible again after `delay` (whole seconds; zero makes it visible at once).
        self.change_visibility(delay).await
    }

    async fn dead_letter(&self, reason: &str) -> Result<(), BrokerError> {
        // Sent first, deleted second: a failure in between leaves a copy in both queues, never
        // in neither.
        self.send_to_dead_letter_queue(reason).await?;
        self.delete().await
    }

    fn keep_alive_every(&self) -> Option<Duration> {
        // A third of the timeout: two extensions may be late before the message is visible.
        (self.heartbeat && !self.shared.visibility.is_zero()).then(|| self.shared.visibility / 3)
    }

    async fn keep_alive(&self) -> Result<(), BrokerError> {
        extend(&self.shared, &self.receipt, self.shared.visibility).await
    }
}
