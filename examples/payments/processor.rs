//! With `PROCESSOR_URL`: a new payment is one keyed operation in steps (recovery points), the
//! way a real service charges through Stripe or Adyen.
//!
//! 1. local phase `record`: the payment row, `pending` (its id is made inside the step, so
//!    every attempt sees the same one);
//! 2. foreign call `charge`: `POST {PROCESSOR_URL}/charges` with the key derived from the
//!    payment's key and the caller's own `Authorization`;
//! 3. local phase `paid`: the processor's charge id recorded, the payment `paid`.
//!
//! Each local phase commits with its journal entry; a retry (from this or another process)
//! resumes after the last journaled step, so whatever process dies whenever, the processor
//! charges once and the database holds one paid payment per key. `PAYMENTS_STEPS=off` runs
//! the same calls without steps, with a fresh key per attempt (what the separate mode alone
//! does): a crash after the charge then charges twice.
//!
//! `PAYMENTS_PAUSE_AT=before-charge|after-charge|after-journal|after-local` stops the request
//! at that step boundary for good (for crash tests, which SIGKILL the process there);
//! `PAYMENTS_DELAY_BETWEEN_STEPS_MS` sleeps between steps.

use std::{sync::Arc, time::Duration};

use axum::{
    http::{header, HeaderMap, HeaderValue, Request, StatusCode},
    response::{IntoResponse, Response},
    Json,
};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::TokioExecutor,
};
use serde::Deserialize;
use serde_json::json;
use tower_idempotency::{
    steps::{KeyOwner, MySqlJournal, PostgresJournal, SqliteJournal, StepError, Steps},
    store::{MySqlStore, PostgresStore, SqliteStore},
};

use crate::{backends::Error, pipeline::var, problem, sql_payments::SqlPayments};

/// The extra table: which processor charge paid which payment.
const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS payment_charges (
    payment_id VARCHAR(32) NOT NULL PRIMARY KEY,
    charge_id  VARCHAR(64) NOT NULL
)";

/// The card processor downstream, and the journal of the payments' steps.
pub struct Processor {
    url: String,
    client: Client<HttpConnector, Full<Bytes>>,
    journal: Journal,
    steps: bool,
    pause_at: Option<String>,
    between: Duration,
}

/// The step journal in the payments database.
enum Journal {
    Postgres(PostgresJournal),
    MySql(MySqlJournal),
    Sqlite(SqliteJournal),
}

#[derive(Deserialize)]
struct Charged {
    id: String,
}

/// Why a payment could not be made this time (the retry resumes).
#[derive(Debug, thiserror::Error)]
enum Failed {
    #[error("the processor answered {0}")]
    Processor(StatusCode),
    #[error("the processor is unreachable: {0}")]
    Unreachable(#[from] Error),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl Processor {
    /// From `PROCESSOR_URL`, on the payments database (PostgreSQL, MySQL / MariaDB or SQLite).
    pub async fn configured(database: Option<&SqlPayments>) -> Result<Option<Arc<Self>>, Error> {
        let Some(url) = var("PROCESSOR_URL") else {
            return Ok(None);
        };
        let journal = match database {
            Some(SqlPayments::Postgres(pool, _)) => {
                sqlx::query(SCHEMA).execute(pool).await?;
                let journal = PostgresJournal::for_store(&PostgresStore::new(pool.clone()));
                journal.migrate().await?;
                Journal::Postgres(journal)
            }
            Some(SqlPayments::MySql(pool, _)) => {
                sqlx::query(SCHEMA).execute(pool).await?;
                let journal = MySqlJournal::for_store(&MySqlStore::new(pool.clone()));
                journal.migrate().await?;
                Journal::MySql(journal)
            }
            Some(SqlPayments::Sqlite(pool, _)) => {
                sqlx::query(SCHEMA).execute(pool).await?;
                let journal = SqliteJournal::for_store(&SqliteStore::new(pool.clone()));
                journal.migrate().await?;
                Journal::Sqlite(journal)
            }
            _ => {
                return Err(
                    "PROCESSOR_URL needs a postgres://, mysql:// or sqlite:// DATABASE_URL".into(),
                )
            }
        };
        let between = crate::pipeline::number("PAYMENTS_DELAY_BETWEEN_STEPS_MS", 0)?;
        Ok(Some(Arc::new(Self {
            url: url.trim_end_matches('/').to_owned(),
            client: Client::builder(TokioExecutor::new()).build_http(),
            journal,
            steps: var("PAYMENTS_STEPS").as_deref() != Some("off"),
            pause_at: var("PAYMENTS_PAUSE_AT"),
            between: Duration::from_millis(between),
        })))
    }

    /// `POST /payments` through the processor.
    pub async fn create(
        &self,
        headers: &HeaderMap,
        owner: Option<&KeyOwner>,
        amount: i64,
        currency: &str,
    ) -> Response {
        let made = match (&self.journal, owner.filter(|_| self.steps)) {
            (Journal::Postgres(journal), Some(owner)) => {
                let steps = resumed(Steps::resume(journal.clone(), owner.clone()).await);
                self.steps_postgres(steps, headers, amount, currency).await
            }
            (Journal::MySql(journal), Some(owner)) => {
                let steps = resumed(Steps::resume(journal.clone(), owner.clone()).await);
                self.steps_mysql(steps, headers, amount, currency).await
            }
            (Journal::Sqlite(journal), Some(owner)) => {
                let steps = resumed(Steps::resume(journal.clone(), owner.clone()).await);
                self.steps_sqlite(steps, headers, amount, currency).await
            }
            (Journal::Postgres(journal), None) => {
                self.plain_postgres(journal.pool(), headers, amount, currency)
                    .await
            }
            (Journal::MySql(journal), None) => {
                self.plain_mysql(journal.pool(), headers, amount, currency)
                    .await
            }
            (Journal::Sqlite(journal), None) => {
                self.plain_sqlite(journal.pool(), headers, amount, currency)
                    .await
            }
        };
        match made {
            Ok((id, charge_id)) => paid(&id, amount, currency, &charge_id),
            Err(StepError::Fenced { .. }) => problem::lease_lost(),
            Err(error) => {
                tracing::warn!(error = %error, "payment not finished; a retry resumes it");
                problem::processor_unavailable()
            }
        }
    }

    /// `POST {PROCESSOR_URL}/charges` under `key`, as the caller: the charge's id.
    async fn charge(
        &self,
        headers: &HeaderMap,
        key: String,
        amount: i64,
        currency: &str,
    ) -> Result<String, Failed> {
        let mut request = Request::post(format!("{}/charges", self.url))
            .header(header::CONTENT_TYPE, "application/json")
            .header("idempotency-key", key);
        if let Some(caller) = headers.get(header::AUTHORIZATION) {
            request = request.header(header::AUTHORIZATION, caller);
        }
        let body = json!({ "amount": amount, "currency": currency }).to_string();
        let request = request
            .body(Full::from(body))
            .map_err(|e| Failed::Unreachable(e.into()))?;
        let response = self
            .client
            .request(request)
            .await
            .map_err(|e| Failed::Unreachable(e.into()))?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| Failed::Unreachable(e.into()))?
            .to_bytes();
        if status != StatusCode::CREATED {
            return Err(Failed::Processor(status));
        }
        let charged: Charged =
            serde_json::from_slice(&body).map_err(|e| Failed::Unreachable(e.into()))?;
        self.boundary("after-charge").await;
        Ok(charged.id)
    }

    /// A step boundary: `PAYMENTS_PAUSE_AT` stops here for good (a test kills the process),
    /// `PAYMENTS_DELAY_BETWEEN_STEPS_MS` sleeps.
    async fn boundary(&self, point: &str) {
        if self.pause_at.as_deref() == Some(point) {
            tracing::info!("steps: paused at {point}");
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(self.between).await;
    }
}

fn resumed<J>(
    steps: Result<Steps<J>, tower_idempotency::store::StoreError>,
) -> Result<Steps<J>, StepError<Failed>> {
    steps.map_err(|source| StepError::Store {
        step: "resume".to_owned(),
        source,
    })
}

/// The answer: 201 with the paid payment, its `ETag` and `Location`.
fn paid(id: &str, amount: i64, currency: &str, charge_id: &str) -> Response {
    let body = json!({
        "id": id, "amount": amount, "currency": currency,
        "status": "paid", "version": 2, "charge_id": charge_id,
    });
    let mut response = (StatusCode::CREATED, Json(body)).into_response();
    let headers = response.headers_mut();
    headers.insert(header::ETAG, HeaderValue::from_static("\"2\""));
    if let Ok(location) = HeaderValue::from_str(&format!("/payments/{id}")) {
        headers.insert(header::LOCATION, location);
    }
    response
}

/// The steps, and the same calls without them, written once for every database (`$1` / `?1`
/// are their placeholders).
macro_rules! flows {
    ($steps:ident, $plain:ident, $db:ty, $insert_payment:literal, $insert_charge:literal, $mark_paid:literal) => {
        impl Processor {
            async fn $steps(
                &self,
                steps: Result<Steps<tower_idempotency::steps::SqlJournal<$db>>, StepError<Failed>>,
                headers: &HeaderMap,
                amount: i64,
                currency: &str,
            ) -> Result<(String, String), StepError<Failed>> {
                let steps = steps?;
                let code = currency.to_owned();
                let id: String = steps
                    .local("record", move |conn| {
                        Box::pin(async move {
                            let id = format!("pay_{:016x}", rand::random::<u64>());
                            sqlx::query($insert_payment)
                                .bind(&id)
                                .bind(amount)
                                .bind(&code)
                                .bind("pending")
                                .bind(1_i64)
                                .execute(&mut *conn)
                                .await?;
                            Ok::<_, Failed>(id)
                        })
                    })
                    .await?;
                self.boundary("before-charge").await;
                let charge_id: String = steps
                    .foreign("charge", |key| self.charge(headers, key, amount, currency))
                    .await?;
                self.boundary("after-journal").await;
                let (payment, charge) = (id.clone(), charge_id.clone());
                steps
                    .local("paid", move |conn| {
                        Box::pin(async move {
                            sqlx::query($mark_paid)
                                .bind(&payment)
                                .execute(&mut *conn)
                                .await?;
                            sqlx::query($insert_charge)
                                .bind(&payment)
                                .bind(&charge)
                                .execute(&mut *conn)
                                .await?;
                            Ok::<_, Failed>(())
                        })
                    })
                    .await?;
                self.boundary("after-local").await;
                Ok((id, charge_id))
            }

            /// Without steps: a fresh key downstream on every attempt, then the local rows.
            async fn $plain(
                &self,
                pool: &sqlx::Pool<$db>,
                headers: &HeaderMap,
                amount: i64,
                currency: &str,
            ) -> Result<(String, String), StepError<Failed>> {
                let failed = |source| StepError::Step {
                    step: "plain".to_owned(),
                    source,
                };
                let key = format!("{:032x}", rand::random::<u128>());
                let charge_id = self
                    .charge(headers, key, amount, currency)
                    .await
                    .map_err(failed)?;
                let id = format!("pay_{:016x}", rand::random::<u64>());
                sqlx::query($insert_payment)
                    .bind(&id)
                    .bind(amount)
                    .bind(currency)
                    .bind("paid")
                    .bind(2_i64)
                    .execute(pool)
                    .await
                    .map_err(|e| failed(e.into()))?;
                sqlx::query($insert_charge)
                    .bind(&id)
                    .bind(&charge_id)
                    .execute(pool)
                    .await
                    .map_err(|e| failed(e.into()))?;
                self.boundary("after-local").await;
                Ok((id, charge_id))
            }
        }
    };
}

flows!(
    steps_postgres,
    plain_postgres,
    sqlx::Postgres,
    "INSERT INTO payments (id, amount, currency, status, version) VALUES ($1, $2, $3, $4, $5)",
    "INSERT INTO payment_charges (payment_id, charge_id) VALUES ($1, $2)",
    "UPDATE payments SET status = 'paid', version = 2 WHERE id = $1"
);
flows!(
    steps_sqlite,
    plain_sqlite,
    sqlx::Sqlite,
    "INSERT INTO payments (id, amount, currency, status, version) VALUES (?, ?, ?, ?, ?)",
    "INSERT INTO payment_charges (payment_id, charge_id) VALUES (?, ?)",
    "UPDATE payments SET status = 'paid', version = 2 WHERE id = ?"
);
flows!(
    steps_mysql,
    plain_mysql,
    sqlx::MySql,
    "INSERT INTO payments (id, amount, currency, status, version) VALUES (?, ?, ?, ?, ?)",
    "INSERT INTO payment_charges (payment_id, charge_id) VALUES (?, ?)",
    "UPDATE payments SET status = 'paid', version = 2 WHERE id = ?"
);
