//! The `payments` service's side of a pipeline process test: its tables counted behind its
//! back, and clients that send every key twice (at once or one after the other) and retry
//! until 201, as a client of a service that is being killed would.

use std::{sync::Arc, time::Duration};

use http::StatusCode;
use sqlx::PgPool;
use tokio::{
    sync::{watch, Barrier},
    task::JoinSet,
    time::Instant,
};

use crate::process::{shared::Shared, Charge, Http, Reply};

/// The example's tables in the test's schema, counted behind its back.
pub struct Ledger {
    pub url: String,
    pub pool: PgPool,
}

impl Ledger {
    pub async fn new(shared: &Shared) -> Self {
        let Shared::Postgres { url, .. } = shared else {
            panic!("the payments pipeline tests run on PostgreSQL")
        };
        let pool = PgPool::connect(url).await.expect("connect to the schema");
        Self {
            url: url.clone(),
            pool,
        }
    }

    async fn ids(&self, sql: &str) -> Vec<String> {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// The ids of the `payments` rows.
    pub async fn payments(&self) -> Vec<String> {
        self.ids("SELECT id FROM payments").await
    }

    /// The payment id of each `charges` row.
    pub async fn charges(&self) -> Vec<String> {
        self.ids("SELECT payment_id FROM charges").await
    }

    /// The payload of each outbox row, sent or not.
    pub async fn events(&self) -> Vec<serde_json::Value> {
        let rows: Vec<(String, String, Vec<u8>)> =
            sqlx::query_as("SELECT id, topic, payload FROM tower_outbox ORDER BY seq")
                .fetch_all(&self.pool)
                .await
                .expect("read the outbox");
        rows.into_iter()
            .map(|(id, topic, payload)| {
                assert_eq!(topic, "payment.created");
                let event: serde_json::Value =
                    serde_json::from_slice(&payload).expect("the payload is JSON");
                assert_eq!(event["event_id"], id.as_str(), "event_id is the message id");
                event
            })
            .collect()
    }
}

#[async_trait::async_trait]
impl super::PipelineDb for Ledger {
    fn url(&self) -> &str {
        &self.url
    }
    async fn receipts(&self) -> std::collections::HashMap<String, i64> {
        super::pg_receipts(&self.pool).await
    }
    async fn unsent(&self) -> i64 {
        super::pg_unsent(&self.pool).await
    }
}

/// Sends `charge` through whichever payments process is up until it answers 201: a killed
/// process (transport error), a copy in flight (409) and a failure (5xx) are retried with the
/// same key, as a client would.
pub async fn charge_until_created(current: &watch::Receiver<Http>, charge: &Charge) -> Reply {
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let http = current.borrow().clone();
        match http.try_charge(charge).await {
            Ok(reply) if reply.status == StatusCode::CREATED => return reply,
            Ok(reply) => assert!(
                reply.status == StatusCode::CONFLICT || reply.status.is_server_error(),
                "unexpected {}: {:?}",
                reply.status,
                reply.body
            ),
            Err(_) => {}
        }
        assert!(
            Instant::now() < deadline,
            "no 201 within 40 s for {charge:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Both copies of one key, concurrently (behind a barrier) or one after the other; returns
/// the payment id, after checking that both got the same answer.
pub async fn pay_twice(current: watch::Receiver<Http>, key: String, concurrent: bool) -> String {
    let charge = Charge::new(&key, "alice");
    let replies = if concurrent {
        let barrier = Arc::new(Barrier::new(2));
        let mut copies = JoinSet::new();
        for _ in 0..2 {
            let (current, charge, barrier) = (current.clone(), charge.clone(), barrier.clone());
            copies.spawn(async move {
                barrier.wait().await;
                charge_until_created(&current, &charge).await
            });
        }
        copies.join_all().await
    } else {
        vec![
            charge_until_created(&current, &charge).await,
            charge_until_created(&current, &charge).await,
        ]
    };
    assert_eq!(
        replies[0].identity(),
        replies[1].identity(),
        "the two copies of {key} got different answers"
    );
    replies[0].json()["id"]
        .as_str()
        .expect("id is a string")
        .to_owned()
}
