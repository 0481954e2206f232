//! An SQS client on the local endpoint (moto at `TEST_SQS_URL`), and queues of a test's own.

use std::time::Duration;

use tower_idempotency::broker::sqs::{
    aws_sdk_sqs::{
        config::{BehaviorVersion, Credentials, Region},
        types::QueueAttributeName,
        Client,
    },
    SqsQueues, SqsTopology,
};

use crate::process::{shared::url_or_skip, unique};

/// A client for the SQS endpoint at `url`: test credentials, region us-east-1, plain HTTP.
pub fn client(url: &str) -> Client {
    let config = tower_idempotency::broker::sqs::aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "tests"))
        .endpoint_url(url)
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    Client::from_conf(config)
}

/// A queue pair of this test's own on `TEST_SQS_URL` (skips when unset).
#[derive(Clone)]
pub struct TestQueues {
    pub url: String,
    pub client: Client,
    pub topology: SqsTopology,
    pub queues: SqsQueues,
}

impl TestQueues {
    /// Declares `receipts_<random>` (with `.fifo` when `fifo`) and its dead-letter queue.
    pub async fn new(fifo: bool, visibility: Duration) -> Option<Self> {
        let url = url_or_skip("TEST_SQS_URL")?;
        let client = client(&url);
        let suffix = if fifo { ".fifo" } else { "" };
        let mut topology = SqsTopology::new(format!("receipts_{}{suffix}", unique()));
        topology.visibility_timeout = visibility;
        let queues = topology
            .declare(&client)
            .await
            .unwrap_or_else(|e| panic!("TEST_SQS_URL is set but SQS is unreachable: {e}"));
        Some(Self {
            url,
            client,
            topology,
            queues,
        })
    }

    /// Messages in `queue_url`, visible or in flight.
    pub async fn count(&self, queue_url: &str) -> u64 {
        queue_count(&self.client, queue_url).await
    }

    /// Deletes both queues.
    pub async fn clean_up(&self) {
        for url in [&self.queues.queue_url, &self.queues.dead_letter_url] {
            let _ = self.client.delete_queue().queue_url(url).send().await;
        }
    }
}

/// Messages in `queue_url`, visible or in flight.
pub async fn queue_count(client: &Client, queue_url: &str) -> u64 {
    let attributes = client
        .get_queue_attributes()
        .queue_url(queue_url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
        .expect("queue attributes")
        .attributes
        .unwrap_or_default();
    [
        QueueAttributeName::ApproximateNumberOfMessages,
        QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
    ]
    .iter()
    .filter_map(|name| attributes.get(name)?.parse::<u64>().ok())
    .sum()
}
