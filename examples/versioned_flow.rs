//! Optimistic concurrency end to end, against SQLite in a temporary file:
//! read with an ETag, update with If-Match, lose a race (412 with the current ETag), forget
//! If-Match (428), then let `retry_on_conflict` redo a read-modify-write until it wins.
//!
//!     cargo run --example versioned_flow --features axum,sqlite

use std::{
    sync::{
        atomic::{AtomicU32, Ordering},
        Arc,
    },
    time::Duration,
};

use axum::{
    body::Body,
    extract::{Path, State},
    http::{Request, StatusCode},
    response::IntoResponse,
    routing::get,
    Json, Router,
};
use http_body_util::BodyExt;
use serde::{Deserialize, Serialize};
use sqlx::{
    sqlite::{SqliteConnectOptions, SqliteJournalMode},
    SqlitePool,
};
use tower::ServiceExt;
use tower_idempotency::version::{
    commit_if_updated, retry_on_conflict, ETag, PreconditionRejection, RequireIfMatch, RetryPolicy,
    VersionedTable,
};

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
struct Payment {
    id: String,
    status: String,
    refunds: i64,
    version: i64,
}

#[derive(Deserialize)]
struct Change {
    status: String,
}

#[derive(Clone)]
struct App {
    pool: SqlitePool,
    payments: Arc<VersionedTable>,
}

type Error = Box<dyn std::error::Error + Send + Sync>;

async fn get_payment(
    State(app): State<App>,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, PreconditionRejection> {
    match app.payments.fetch::<_, _, _, Payment>(&app.pool, id).await {
        Ok(Some((version, payment))) => Ok((ETag::from(version), Json(payment)).into_response()),
        Ok(None) => Err(PreconditionRejection::NotFound),
        Err(error) => Ok((StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response()),
    }
}

/// `If-Match` is required; the update is ONE conditional statement, no read before it.
async fn patch_payment(
    State(app): State<App>,
    Path(id): Path<String>,
    RequireIfMatch(preconditions): RequireIfMatch,
    Json(change): Json<Change>,
) -> Result<impl IntoResponse, PreconditionRejection> {
    let outcome = app
        .payments
        .update_if_version_returning::<_, _, _, Payment>(
            &app.pool,
            id,
            preconditions.expected(),
            |set| {
                set.value("status", change.status);
            },
        )
        .await;
    match outcome {
        Ok(outcome) => {
            let (version, row) = outcome.into_http()?;
            Ok((ETag::from(version), Json(row)).into_response())
        }
        Err(error) => Ok((StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response()),
    }
}

async fn call(
    router: &Router,
    method: &str,
    if_match: Option<&str>,
    body: &str,
) -> Result<(), Error> {
    let mut request = Request::builder()
        .method(method)
        .uri("/payments/pay_1")
        .header("content-type", "application/json");
    if let Some(tag) = if_match {
        request = request.header("if-match", tag);
    }
    let response = router
        .clone()
        .oneshot(request.body(Body::from(body.to_owned()))?)
        .await?;
    let status = response.status();
    let etag = response
        .headers()
        .get("etag")
        .map(|v| v.to_str().unwrap_or("?").to_owned());
    let body = response.into_body().collect().await?.to_bytes();
    println!(
        "{method:5} If-Match: {:6} -> {status} ETag: {:5} {}",
        if_match.unwrap_or("-"),
        etag.unwrap_or_else(|| "-".into()),
        String::from_utf8_lossy(&body)
    );
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let path = std::env::temp_dir().join(format!("versioned-flow-{}.sqlite", std::process::id()));
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(5));
    let pool = SqlitePool::connect_with(options).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS payments (id TEXT PRIMARY KEY, status TEXT NOT NULL, \
         refunds INTEGER NOT NULL, version INTEGER NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let payments = Arc::new(VersionedTable::new("payments", "id", "version")?);
    let created = payments
        .insert_new(&pool, "pay_1", |set| {
            set.value("status", "pending").value("refunds", 0i64);
        })
        .await?;
    println!("created pay_1: {created:?}");
    let created_again = payments
        .insert_new(&pool, "pay_1", |set| {
            set.value("status", "pending").value("refunds", 0i64);
        })
        .await?;
    println!("create-only insert again: {created_again:?}\n");

    let app = App {
        pool: pool.clone(),
        payments: payments.clone(),
    };
    let router = Router::new()
        .route("/payments/{id}", get(get_payment).patch(patch_payment))
        .with_state(app);

    println!("1. read, then update with the ETag we read:");
    call(&router, "GET", None, "").await?;
    call(&router, "PATCH", Some("\"1\""), r#"{"status":"paid"}"#).await?;
    println!("\n2. a second client still holding ETag \"1\" loses the race:");
    call(&router, "PATCH", Some("\"1\""), r#"{"status":"failed"}"#).await?;
    println!("\n3. a client that sends no If-Match at all:");
    call(&router, "PATCH", None, r#"{"status":"failed"}"#).await?;

    println!("\n4. four concurrent refunds, each a read-modify-write retried on conflict:");
    let policy = RetryPolicy::default().max_attempts(20);
    let attempts = Arc::new(AtomicU32::new(0));
    let tasks: Vec<_> = (0..4)
        .map(|worker| {
            let (pool, payments, policy, attempts) = (
                pool.clone(),
                payments.clone(),
                policy.clone(),
                attempts.clone(),
            );
            tokio::spawn(async move {
                retry_on_conflict(&policy, || async {
                    attempts.fetch_add(1, Ordering::Relaxed);
                    let mut tx = pool.begin().await?;
                    let (version, payment) = payments
                        .fetch::<_, _, _, Payment>(&mut *tx, "pay_1")
                        .await?
                        .ok_or("pay_1 vanished")?;
                    tokio::time::sleep(Duration::from_millis(5)).await; // think time: invites races
                    let outcome = payments
                        .update_if_version(&mut *tx, "pay_1", version, |set| {
                            set.value("refunds", payment.refunds + 1)
                                .value("status", "refunded");
                        })
                        .await?;
                    let outcome = commit_if_updated(tx, outcome).await?;
                    println!("   worker {worker}: read version {version}, outcome {outcome:?}");
                    Ok::<_, Error>(outcome)
                })
                .await
            })
        })
        .collect();
    for task in tasks {
        let outcome = task.await??;
        if !outcome.is_updated() {
            println!(
                "   a refund gave up after {} attempts: {outcome:?}",
                policy.attempts()
            );
        }
    }
    let (version, payment) = payments
        .fetch::<_, _, _, Payment>(&pool, "pay_1")
        .await?
        .ok_or("gone")?;
    println!(
        "   {} attempts for 4 refunds; now refunds = {}, version = {version}",
        attempts.load(Ordering::Relaxed),
        payment.refunds
    );

    pool.close().await;
    for suffix in ["", "-wal", "-shm"] {
        let mut file = path.clone().into_os_string();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
    Ok(())
}
