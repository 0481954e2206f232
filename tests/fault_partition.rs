//! Network faults between a service process and its store, with real processes and a real
//! PostgreSQL: two `payments` processes share one database in the transactional mode, one of
//! them in its own network namespace (`tests/common/netns.rs`), whose store link the test
//! takes down for longer than the lease, or slows down.
//!
//! The checks count in the database, not in status codes: every key's charge ran exactly once
//! (no double, none lost), both copies of a key got the same final answer, and no key is
//! stuck (every client got a final answer, and a later copy replays it at once).
//! Clients retry until a final answer (`201`), as a real client would after a `5xx` or `409`.
//!
//! Measured (8 keys, lease 2 s, partition 3.5 s while every key is claimed):
//! - PostgreSQL, transactional: no double, none lost or stuck, one answer per key. The
//!   database ends the cut-off owner's idle transaction after the lease, the other process
//!   charges; after the heal the cut-off process answers its clients `500` (its insert met the
//!   terminated connection; nothing of it persists) and their retry replays the other's `201`.
//! - Redis, separate mode: every key charged twice, the two copies answered with different
//!   payments: the separate mode's documented limit (effect done, record not written), here
//!   produced by a partition instead of a crash.
//! - Store 150 ms away (PostgreSQL, transactional, 8 keys sent to both processes at once): no
//!   double, one answer per key.
//!
//! Loss is not injected: see `tests/common/netns.rs` (no `sch_netem` on this kernel).
#![cfg(all(feature = "postgres", feature = "sqlite", feature = "redis"))]

#[path = "harness/effects.rs"]
mod effects;
#[path = "process/netns.rs"]
mod netns;
mod process;

use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, Instant},
};

use effects::charge_of;
use http::StatusCode;
use netns::{isolated_or_skip, start_isolated};
use process::{shared::Shared, unique, Charge, Http, Launch, Reply};

/// Longer than any key needs to settle; a client without a final answer by then is stuck.
const SETTLE: Duration = Duration::from_secs(30);
const LEASE_MS: u64 = 2_000;

/// What one client of one key saw: every answer (or transport error) in order, and the final
/// answer if it got one.
#[derive(Debug, Default)]
struct History {
    seen: Vec<String>,
    last: Option<Reply>,
}

/// Sends `charge` to `http` until a final answer (`201`, or any `4xx` but `409`) or until
/// [`SETTLE`]; retries after a transport error, a `5xx` or a `409`.
async fn until_final(http: Http, charge: Charge) -> History {
    let deadline = Instant::now() + SETTLE;
    let mut history = History::default();
    while Instant::now() < deadline {
        match http.try_charge(&charge).await {
            Ok(reply) => {
                history.seen.push(reply.status.as_u16().to_string());
                let retry = reply.status.is_server_error() || reply.status == StatusCode::CONFLICT;
                if !retry {
                    history.last = Some(reply);
                    return history;
                }
            }
            Err(error) => history.seen.push(format!("transport error: {error}")),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    history
}

/// The keys of one run: key `i` charges amount `i + 1`, so the charges of each key can be
/// counted in the database by their amount.
fn charges(n: i64) -> Vec<Charge> {
    let caller = unique();
    (1..=n).map(|amount| charge_of(amount, &caller)).collect()
}

/// The charge rows per amount, counted in the database itself.
async fn charges_by_amount(shared: &Shared) -> HashMap<i64, i64> {
    let mut counted = HashMap::new();
    for row in effects::charges(shared).await {
        *counted.entry(row.amount).or_insert(0) += 1;
    }
    counted
}

/// What the checker found; every field but `keys` must be zero.
#[derive(Debug, Default, PartialEq, Eq)]
struct Verdict {
    keys: usize,
    /// Keys charged more than once.
    doubles: usize,
    /// Keys answered `201` and charged zero times.
    lost: usize,
    /// Keys with a client that got no final answer, or whose later copy gets no final answer
    /// at once, or one that neither copy got.
    stuck: usize,
    /// Keys whose two copies got different final answers.
    mismatched: usize,
}

impl Verdict {
    fn clean(&self) -> bool {
        *self
            == Verdict {
                keys: self.keys,
                ..Verdict::default()
            }
    }
}

/// Checks the histories of both copies of every key against the database, and asks `later`
/// for each key once more (it must replay the final answer at once).
async fn check(shared: &Shared, keys: &[Charge], copies: &[[History; 2]], later: &Http) -> Verdict {
    let counted = charges_by_amount(shared).await;
    let mut verdict = Verdict {
        keys: keys.len(),
        ..Verdict::default()
    };
    for (i, (charge, [one, two])) in keys.iter().zip(copies).enumerate() {
        let charged = counted.get(&(i as i64 + 1)).copied().unwrap_or(0);
        let answered = [one, two].iter().any(|h| {
            h.last
                .as_ref()
                .is_some_and(|r| r.status == StatusCode::CREATED)
        });
        verdict.doubles += usize::from(charged > 1);
        verdict.lost += usize::from(charged == 0 && answered);
        match (&one.last, &two.last) {
            (Some(a), Some(b)) => {
                verdict.mismatched += usize::from(a.identity() != b.identity());
                // A later copy must get a final answer at once, and one of the answers given.
                let again = tokio::time::timeout(Duration::from_secs(2), later.try_charge(charge))
                    .await
                    .ok()
                    .and_then(Result::ok);
                let replays = again.is_some_and(|r| {
                    r.status == StatusCode::CREATED
                        && (r.identity() == a.identity() || r.identity() == b.identity())
                });
                verdict.stuck += usize::from(!replays);
            }
            _ => verdict.stuck += 1,
        }
    }
    verdict
}

/// The answers clients of one process saw, counted by kind (`201`, `503`, transport error).
fn tally<'a>(histories: impl Iterator<Item = &'a History>) -> BTreeMap<String, usize> {
    let mut tally = BTreeMap::new();
    for seen in histories.flat_map(|h| &h.seen) {
        let kind = seen.split(':').next().unwrap_or(seen).to_owned();
        *tally.entry(kind).or_insert(0) += 1;
    }
    tally
}

/// The transactional mode, without the store's address: the isolated process gets it
/// rewritten to its proxies, the other one as it is.
fn transactional() -> Launch {
    Launch::new().env("IDEMPOTENCY_MODE", "transactional")
}

/// The isolated process claims every key (its handler sleeps before the charge), then loses
/// its store for longer than the lease; the other process gets the duplicates and charges
/// them; the partition heals and the isolated process's clients retry.
async fn partition_past_the_lease(shared: Shared) {
    let (verdict, copies) = partition_while_claimed(&shared, transactional()).await;
    assert!(verdict.clean(), "{verdict:?}\n{copies:#?}");
    // The partition was real: the cut-off process could not answer its clients first time.
    let cut_off_answers = tally(copies.iter().map(|[one, _]| one));
    assert!(
        copies.iter().all(|[one, _]| one.seen.len() > 1),
        "a client of the isolated process was answered at once: {cut_off_answers:?}"
    );
}

/// The separate mode, records in Redis, charges in a SQLite file the partition does not cut:
/// the isolated process charges each key before its lease ends (the handler sleeps 1 s, the
/// lease is 2 s) but cannot record it; the other process takes the key over once the lease
/// has ended and charges again. Every key is a double: the same window as a crash between
/// the effect and its record, the mode's documented limit. The isolated process answers its
/// own client `201` with its own payment (the charge did happen; its record could not be
/// written), so the two copies of each key get different payments: measured, 8 of 8. Nothing
/// else may go wrong: no key lost or stuck.
async fn separate_redis_partition_doubles_each_claimed_key(shared: Shared) {
    let launch = Launch::new().env("IDEMPOTENCY_MODE", "separate");
    let (verdict, copies) = partition_while_claimed(&shared, launch).await;
    assert_eq!(
        verdict,
        Verdict {
            keys: verdict.keys,
            doubles: verdict.keys,
            mismatched: verdict.keys,
            ..Verdict::default()
        },
        "only the documented double\n{copies:#?}"
    );
}

/// The partition scenario in `mode` (see [`partition_past_the_lease`]): the verdict and
/// both clients' histories of every key.
async fn partition_while_claimed(shared: &Shared, mode: Launch) -> (Verdict, Vec<[History; 2]>) {
    let Some(mut isolated) = isolated_or_skip() else {
        return (Verdict::default(), Vec::new());
    };
    let launch = mode.env("IDEMPOTENCY_LEASE_MS", LEASE_MS);
    let cut_off = start_isolated(
        &mut isolated,
        launch.clone().env("PAYMENTS_HANDLER_DELAY_MS", 1_000),
        &shared.env(),
    )
    .await;
    let other = launch.envs(&shared.env()).start().await;
    // Fewer keys than the pool's 10 connections: each claim holds one.
    let keys = charges(8);

    let first: Vec<_> = keys
        .iter()
        .map(|charge| tokio::spawn(until_final(cut_off.http(), charge.clone())))
        .collect();
    let deadline = Instant::now() + SETTLE;
    while count_lines(&cut_off, "charging after PAYMENTS_HANDLER_DELAY_MS") < keys.len() {
        assert!(
            Instant::now() < deadline,
            "the isolated process claimed no key"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Every key is claimed, its transaction open and its handler asleep.
    isolated.partition();
    let second: Vec<_> = keys
        .iter()
        .map(|charge| tokio::spawn(until_final(other.http(), charge.clone())))
        .collect();
    tokio::time::sleep(Duration::from_millis(LEASE_MS + 1_500)).await;
    isolated.heal();

    let mut copies = Vec::new();
    for (one, two) in first.into_iter().zip(second) {
        copies.push([one.await.expect("client"), two.await.expect("client")]);
    }
    let verdict = check(shared, &keys, &copies, &other).await;
    let cut_off_answers = tally(copies.iter().map(|[one, _]| one));
    let other_answers = tally(copies.iter().map(|[_, two]| two));
    eprintln!(
        "{}: partition {} ms (lease {LEASE_MS} ms): {verdict:?}; the isolated process \
         answered {cut_off_answers:?}, the other {other_answers:?}",
        shared.name(),
        LEASE_MS + 1_500
    );
    (verdict, copies)
}

/// The isolated process's store is 150 ms away (75 ms each way); both copies of every key are
/// sent at once, one to each process.
async fn store_far_away(shared: Shared) {
    let Some(mut isolated) = isolated_or_skip() else {
        return;
    };
    let launch = transactional().env("PAYMENTS_HANDLER_DELAY_MS", 200);
    let far = start_isolated(&mut isolated, launch.clone(), &shared.env()).await;
    let near = launch.envs(&shared.env()).start().await;
    isolated.delay(Duration::from_millis(75));
    // The delay is in effect: `/stats` counts rows through the proxy, one round trip at least.
    let started = Instant::now();
    far.charges().await;
    assert!(
        started.elapsed() >= Duration::from_millis(150),
        "a store round trip took {:?}",
        started.elapsed()
    );
    let keys = charges(8);
    let mut copies = Vec::new();
    let tasks: Vec<_> = keys
        .iter()
        .map(|charge| {
            (
                tokio::spawn(until_final(far.http(), charge.clone())),
                tokio::spawn(until_final(near.http(), charge.clone())),
            )
        })
        .collect();
    for (one, two) in tasks {
        copies.push([one.await.expect("client"), two.await.expect("client")]);
    }
    let verdict = check(&shared, &keys, &copies, &near).await;
    eprintln!(
        "store 150 ms away: {verdict:?}; far answered {:?}, near {:?}",
        tally(copies.iter().map(|[one, _]| one)),
        tally(copies.iter().map(|[_, two]| two)),
    );
    assert!(verdict.clean(), "{verdict:?}\n{copies:#?}");
}

/// The checker can fail: one extra charge row planted behind the service's back is a double.
async fn checker_sees_a_planted_double(shared: Shared) {
    let server = transactional().envs(&shared.env()).start().await;
    let keys = charges(2);
    let mut copies = Vec::new();
    for charge in &keys {
        let (one, two) = tokio::join!(
            until_final(server.http(), charge.clone()),
            until_final(server.http(), charge.clone())
        );
        copies.push([one, two]);
    }
    let clean = check(&shared, &keys, &copies, &server).await;
    assert!(clean.clean(), "{clean:?}");
    let Shared::Postgres { admin, schema, .. } = &shared else {
        unreachable!()
    };
    for statement in [
        format!(
            "INSERT INTO {schema}.payments (id, amount, currency, status, version) \
             VALUES ('planted', 1, 'EUR', 'pending', 1)"
        ),
        format!(
            "INSERT INTO {schema}.charges (id, payment_id, amount, currency) \
             VALUES ('planted', 'planted', 1, 'EUR')"
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(admin)
            .await
            .expect("plant a charge");
    }
    let planted = check(&shared, &keys, &copies, &server).await;
    assert_eq!(
        planted,
        Verdict {
            keys: 2,
            doubles: 1,
            ..Verdict::default()
        }
    );
}

fn count_lines(server: &process::Server, text: &str) -> usize {
    server
        .logs
        .lines()
        .iter()
        .filter(|line| line.contains(text))
        .count()
}

macro_rules! postgres_tests {
    ($($name:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $name() {
            let Some(shared) = super::Shared::postgres().await else {
                return;
            };
            shared.run(super::$name).await;
        }
    )*};
}

mod redis {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn separate_redis_partition_doubles_each_claimed_key() {
        let Some(shared) = super::Shared::redis() else {
            return;
        };
        shared
            .run(super::separate_redis_partition_doubles_each_claimed_key)
            .await;
    }
}

mod postgres {
    postgres_tests!(
        partition_past_the_lease,
        store_far_away,
        checker_sees_a_planted_double
    );
}
