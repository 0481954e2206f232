//! Cross-process wake-ups on PostgreSQL and Redis: a duplicate waiting in another process
//! (here: an engine on a store with its own pool or connection, hence its own listening
//! connection) is woken by the original's completion (in the transactional mode: by the end
//! of the owner's transaction), not by its poll.
//!
//! The waiting side polls once an hour, so within the tests' limits only a notification can
//! wake it; a test that hangs on that limit is a missing notification.
//!
//! ```text
//! TEST_POSTGRES_URL=postgres://postgres@127.0.0.1/test TEST_REDIS_URL=redis://127.0.0.1 \
//!     TEST_REQUIRE_ALL_BACKENDS=1 cargo test --all-features --test wakeups
//! ```
#![cfg(all(feature = "postgres", feature = "redis"))]

mod conformance;

use std::time::Duration;

use bytes::Bytes;
use sqlx::{postgres::PgPoolOptions, PgPool};
use tower_idempotency::{
    engine::Begin,
    store::{PostgresStore, RedisStore, Store},
    transactional::{Transactional, TxBegin},
    Engine, Fingerprint, InProgressPolicy, StoreKey, Token,
};

/// Far longer than any test runs: a waiter woken within the limit was woken by a
/// notification (the first fallback look is a tenth of this away).
const SLOW_POLL: Duration = Duration::from_secs(3600);
/// How long a test waits for a wake-up before calling the notification lost.
const LIMIT: Duration = Duration::from_secs(60);

async fn pool() -> Option<PgPool> {
    let url = conformance::url_or_skip("TEST_POSTGRES_URL")?;
    Some(
        PgPoolOptions::new()
            .max_connections(4)
            .connect(&url)
            .await
            .expect("TEST_POSTGRES_URL is set but the server is unreachable"),
    )
}

/// A table of its own, migrated, and two stores on it with separate pools: two "processes".
async fn two_stores() -> Option<(PostgresStore, PostgresStore, String)> {
    let table = format!("tower_idempotency_wake_{}", &Token::random().to_hex()[..12]);
    let open = |pool| {
        PostgresStore::builder(pool)
            .table(&table)
            .completion_notifications(true)
            .build()
            .unwrap()
    };
    let owner = open(pool().await?);
    owner.migrate().await.expect("migrate");
    let waiter = open(pool().await?);
    Some((owner, waiter, table))
}

fn engine(store: impl Store, poll_when_notified: Duration) -> Engine {
    Engine::builder(store)
        .poll_when_notified(poll_when_notified)
        .in_progress(InProgressPolicy::Wait { timeout: LIMIT * 2 })
        .build()
        .unwrap()
}

fn fingerprint(key: &StoreKey) -> Fingerprint {
    Fingerprint::of([key.key().as_bytes()])
}

/// The backend pid of the connection listening on `table`'s channel, once there is one.
async fn listener_pid(pool: &PgPool, table: &str, not: Option<i32>) -> i32 {
    let pattern = format!("LISTEN %{table}%");
    tokio::time::timeout(LIMIT, async {
        loop {
            let pid: Option<i32> = sqlx::query_scalar(
                "SELECT pid FROM pg_stat_activity WHERE query LIKE $1 AND pid <> $2",
            )
            .bind(&pattern)
            .bind(not.unwrap_or(0))
            .fetch_optional(pool)
            .await
            .unwrap();
            if let Some(pid) = pid {
                return pid;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the store never listened")
}

async fn until_waiting(engine: &Engine) {
    tokio::time::timeout(LIMIT, async {
        while engine.waiting_keys() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the duplicate never started waiting");
}

/// The owner claims a fresh key, the other engine's duplicate starts waiting, the owner
/// completes: the duplicate must replay the answer within the limit.
async fn one_round(owner: &Engine, waiter: &Engine, name: &str) {
    let key = StoreKey::new("wake", format!("{name}-{}", Token::random().to_hex()));
    let Begin::Run(claim) = owner.begin(key.clone(), fingerprint(&key)).await.unwrap() else {
        panic!("a fresh key is the owner's")
    };
    let duplicate = tokio::spawn({
        let (waiter, key) = (waiter.clone(), key.clone());
        async move { waiter.begin(key.clone(), fingerprint(&key)).await }
    });
    until_waiting(waiter).await;
    claim.complete(Bytes::from_static(b"answer")).await.unwrap();
    let begin = tokio::time::timeout(LIMIT, duplicate)
        .await
        .unwrap_or_else(|_| panic!("{name}: the waiter was not woken by the completion"))
        .unwrap()
        .unwrap();
    assert!(
        matches!(&begin, Begin::Replay(answer) if answer == "answer"),
        "{name}: the waiter must replay the original's answer"
    );
}

#[tokio::test]
async fn a_waiter_in_another_process_is_woken_by_the_completion() {
    let Some((owner, waiter, _table)) = two_stores().await else {
        return;
    };
    let (owner, waiter) = (engine(owner, SLOW_POLL), engine(waiter, SLOW_POLL));
    // The first round may also be woken by the listener announcing it (re)subscribed; once
    // it is over, that announcement is behind us and only notifications wake.
    one_round(&owner, &waiter, "warm-up").await;
    one_round(&owner, &waiter, "notified").await;
    one_round(&owner, &waiter, "notified again").await;
}

#[tokio::test]
async fn a_release_wakes_a_waiter_in_another_process_who_then_runs_it() {
    let Some((owner, waiter, _table)) = two_stores().await else {
        return;
    };
    let (owner, waiter) = (engine(owner, SLOW_POLL), engine(waiter, SLOW_POLL));
    one_round(&owner, &waiter, "warm-up").await;
    let key = StoreKey::new("wake", format!("released-{}", Token::random().to_hex()));
    let Begin::Run(claim) = owner.begin(key.clone(), fingerprint(&key)).await.unwrap() else {
        panic!("a fresh key is the owner's")
    };
    let duplicate = tokio::spawn({
        let (waiter, key) = (waiter.clone(), key.clone());
        async move { waiter.begin(key.clone(), fingerprint(&key)).await }
    });
    until_waiting(&waiter).await;
    claim.release().await.unwrap();
    let begin = tokio::time::timeout(LIMIT, duplicate)
        .await
        .expect("the waiter was not woken by the release")
        .unwrap()
        .unwrap();
    assert!(
        matches!(begin, Begin::Run(_)),
        "the released key is the waiter's to run"
    );
}

#[tokio::test]
async fn a_lost_listener_reconnects_and_wakes_again() {
    let Some((owner, waiter, table)) = two_stores().await else {
        return;
    };
    let admin = pool().await.unwrap();
    let (owner, waiter) = (engine(owner, SLOW_POLL), engine(waiter, SLOW_POLL));
    one_round(&owner, &waiter, "warm-up").await;
    // Each store listens on its own connection; kill every listener of this table.
    let first = listener_pid(&admin, &table, None).await;
    let terminated: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE query LIKE $1 AND pg_terminate_backend(pid)",
    )
    .bind(format!("LISTEN %{table}%"))
    .fetch_one(&admin)
    .await
    .unwrap();
    assert!(terminated >= 1, "the listener {first} was there to kill");
    listener_pid(&admin, &table, Some(first)).await;
    // Again, the reconnection's own announcement may wake the first round after it.
    one_round(&owner, &waiter, "after reconnect, warm-up").await;
    one_round(&owner, &waiter, "after reconnect, notified").await;
}

/// The transactional mode's commits notify nobody: a duplicate in another process blocks on
/// the owner's advisory lock (on a connection of its own), which the owner's commit or
/// rollback releases. Both wake it long before its hour-long fallback look.
#[tokio::test]
async fn a_transactional_commit_or_rollback_wakes_a_waiter_in_another_process() {
    let Some((owner_store, waiter_store, _table)) = two_stores().await else {
        return;
    };
    let owner =
        Transactional::with_engine(owner_store.clone(), engine(owner_store.clone(), SLOW_POLL));
    let waiter = Transactional::with_engine(
        waiter_store.clone(),
        engine(waiter_store.clone(), SLOW_POLL),
    );
    let round = |name: &'static str, commit: bool| {
        let (owner, waiter) = (owner.clone(), waiter.clone());
        async move {
            let key = StoreKey::new("wake-tx", format!("{name}-{}", Token::random().to_hex()));
            let TxBegin::Run(tx) = owner.begin(key.clone(), fingerprint(&key)).await.unwrap()
            else {
                panic!("a fresh key is the owner's")
            };
            let duplicate = tokio::spawn({
                let (waiter, key) = (waiter.clone(), key.clone());
                async move { waiter.begin(key.clone(), fingerprint(&key)).await }
            });
            until_waiting(waiter.engine()).await;
            // Give the waiter time to block on the lock, so the wake-up is the lock's.
            tokio::time::sleep(Duration::from_millis(200)).await;
            if commit {
                tx.commit(Bytes::from_static(b"committed")).await.unwrap();
            } else {
                tx.rollback().await;
            }
            tokio::time::timeout(LIMIT, duplicate)
                .await
                .unwrap_or_else(|_| panic!("{name}: the waiter was left waiting"))
                .unwrap()
                .unwrap()
        }
    };
    let replayed = |begin: TxBegin<sqlx::Postgres>| matches!(&begin, TxBegin::Replay(answer) if answer == "committed");
    assert!(
        replayed(round("committed", true).await),
        "the owner's commit wakes the waiter, which replays the committed answer"
    );
    let TxBegin::Run(tx) = round("rolled back", false).await else {
        panic!("after a rollback the key is free: the waiter runs it")
    };
    tx.rollback().await;
}

/// Two Redis stores, each with its own connection and subscriber, under a prefix of their own.
async fn two_redis_stores() -> Option<(RedisStore, RedisStore)> {
    let url = conformance::url_or_skip("TEST_REDIS_URL")?;
    let prefix = format!("wake-test-{}:", &Token::random().to_hex()[..12]);
    let open = || async {
        RedisStore::builder()
            .prefix(prefix.clone())
            .open(&url)
            .await
            .expect("TEST_REDIS_URL is set but the server is unreachable")
    };
    Some((open().await, open().await))
}

#[tokio::test]
async fn redis_a_waiter_in_another_process_is_woken_by_the_completion() {
    let Some((owner, waiter)) = two_redis_stores().await else {
        return;
    };
    let (owner, waiter) = (engine(owner, SLOW_POLL), engine(waiter, SLOW_POLL));
    one_round(&owner, &waiter, "warm-up").await;
    one_round(&owner, &waiter, "notified").await;
    one_round(&owner, &waiter, "notified again").await;
}
