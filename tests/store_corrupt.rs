//! A record the store holds but cannot read: one damaged as a whole (the store cannot decode
//! it), or one whose stored response is damaged (the HTTP layer cannot replay it). Planted in
//! real PostgreSQL and Redis after a real first run. The truth is answered: `500`
//! `record-unreadable`, no `Retry-After` (retrying cannot cure it), nothing runs again, every
//! such answer is counted; and an operator clears it with `Store::forget`, after which the
//! key runs again.

#[path = "common/backends.rs"]
mod backends;
mod common;

use std::{future::Future, pin::Pin, sync::Arc};

use axum::http::{header, StatusCode};
use common::{app, post_req, send, Runs};
use metrics_exporter_prometheus::PrometheusBuilder;
use redis::AsyncCommands;
use tower_idempotency::{
    store::{PostgresStore, RedisStore, Store},
    IdempotencyLayer, StoreKey, Token,
};

const SCOPE: &str = "corrupt-records";

/// The series counting record-unreadable answers, as a dashboard spells it.
const UNREADABLE: &str = "idempotency_requests_total{outcome=\"record_unreadable\"}";

/// What is damaged: the stored record itself, or the response stored in it.
#[derive(Debug, Clone, Copy)]
enum Damage {
    Record,
    Payload,
}

type Plant = Box<dyn Fn(StoreKey, Damage) -> Pin<Box<dyn Future<Output = ()>>>>;

/// Opens the store, and says how to damage a record in it.
type Open = Pin<Box<dyn Future<Output = (Arc<dyn Store>, Plant)>>>;

/// Opens the store, runs a keyed request, damages its record, and checks what its retries
/// get: once per kind of damage. One thread, so a local metrics recorder sees every event.
fn check(open: Open) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (store, plant) = runtime.block_on(open);
    for damage in [Damage::Record, Damage::Payload] {
        // Local: the events of this runtime's one thread, and only this check's.
        let recorder = PrometheusBuilder::new().build_recorder();
        let metrics = recorder.handle();
        ::metrics::with_local_recorder(&recorder, || {
            runtime.block_on(damaged(store.clone(), &plant, damage, &metrics));
        });
    }
}

async fn damaged(
    store: Arc<dyn Store>,
    plant: &Plant,
    damage: Damage,
    metrics: &metrics_exporter_prometheus::PrometheusHandle,
) {
    let runs = Runs::default();
    let layer =
        IdempotencyLayer::from_engine(tower_idempotency::Engine::from_shared(store.clone()))
            .scope_with(|_| SCOPE.to_owned());
    let app = app(layer, runs.clone());
    let key = StoreKey::new(SCOPE, Token::random().to_hex());
    let request = || post_req("/pay", Some(key.key()), "{}");

    assert_eq!(send(&app, request()).await.status, StatusCode::CREATED);
    plant(key.clone(), damage).await;

    for retry in 1..=2 {
        let answer = send(&app, request()).await;
        assert_eq!(
            answer.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{damage:?}: {answer:?}"
        );
        assert_eq!(
            answer.problem_type(),
            "urn:tower-idempotency:record-unreadable",
            "{damage:?}"
        );
        assert!(
            answer.headers.get(header::RETRY_AFTER).is_none(),
            "{damage:?}: {answer:?}"
        );
        let detail = answer.json()["detail"].as_str().unwrap().to_owned();
        assert!(!detail.contains("was not run because"), "{detail}");
        assert_eq!(runs.count(), 1, "{damage:?}: the handler ran again");
        assert_eq!(counter(&metrics.render(), UNREADABLE), retry, "{damage:?}");
    }

    // The operator clears it: the key is free, and its next request runs.
    assert!(
        store.forget(&key).await.unwrap(),
        "{damage:?}: nothing to forget"
    );
    assert!(
        !store.forget(&key).await.unwrap(),
        "{damage:?}: forgot twice"
    );
    assert_eq!(send(&app, request()).await.status, StatusCode::CREATED);
    assert_eq!(runs.count(), 2, "{damage:?}");
}

/// The value of `series` in a Prometheus text rendering; 0 when absent.
fn counter(rendered: &str, series: &str) -> u64 {
    rendered
        .lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_damaged_postgres_record_answers_record_unreadable_until_forgotten() {
    let Some(url) = backends::url_or_skip("TEST_POSTGRES_URL") else {
        return;
    };
    check(Box::pin(async move {
        let store = PostgresStore::new(sqlx::PgPool::connect(&url).await.unwrap());
        store.migrate().await.unwrap();
        let pool = store.pool().clone();
        let plant: Plant = Box::new(move |key, damage| {
            let pool = pool.clone();
            Box::pin(async move {
                // A fingerprint of the wrong length cannot be decoded by the store; a payload that
                // is not a stored response cannot be replayed by the layer.
                let set = match damage {
                    Damage::Record => "fingerprint = '\\x01'::bytea",
                    Damage::Payload => "payload = '\\xdeadbeef'::bytea",
                };
                let done = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "UPDATE tower_idempotency_records SET {set} WHERE scope = $1 AND key = $2"
                )))
                .bind(key.scope())
                .bind(key.key())
                .execute(&pool)
                .await
                .unwrap();
                assert_eq!(done.rows_affected(), 1);
            })
        });
        (Arc::new(store) as Arc<dyn Store>, plant)
    }));
}

#[test]
fn a_damaged_redis_record_answers_record_unreadable_until_forgotten() {
    let Some(url) = backends::url_or_skip("TEST_REDIS_URL") else {
        return;
    };
    check(Box::pin(async move {
        let prefix = format!(
            "tower-idempotency-test:corrupt:{}:",
            Token::random().to_hex()
        );
        let store = RedisStore::builder()
            .prefix(&prefix)
            .open(&url)
            .await
            .unwrap();
        let client = redis::Client::open(url.as_str()).unwrap();
        let redis_keys = store.clone();
        let plant: Plant = Box::new(move |key, damage| {
            let (client, redis_key) = (client.clone(), redis_keys.redis_key(&key));
            Box::pin(async move {
                let mut connection = client.get_multiplexed_async_connection().await.unwrap();
                let value: Vec<u8> = connection.get(&redis_key).await.unwrap();
                // Too short to be a record; or a valid record header (version, state, token,
                // fingerprint: 50 bytes) before a payload that is not a stored response.
                let damaged = match damage {
                    Damage::Record => b"garbage".to_vec(),
                    Damage::Payload => [&value[..50], b"not a response"].concat(),
                };
                let () = redis::cmd("SET")
                    .arg(&redis_key)
                    .arg(damaged)
                    .arg("KEEPTTL")
                    .query_async(&mut connection)
                    .await
                    .unwrap();
            })
        });
        (Arc::new(store) as Arc<dyn Store>, plant)
    }));
}
