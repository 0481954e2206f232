//! The checker of a pipeline run, once the nemesis healed its last fault: it waits for the
//! pipeline to go quiet, then counts in the database (payments, receipts, outbox rows) and in
//! the consumers' logs and the dead-letter queue what became of every payment.

use std::{
    collections::{BTreeMap, HashSet},
    time::Duration,
};

use sqlx::PgPool;
use tokio::time::Instant;

use crate::{
    fleet::{Fleet, Role},
    nemesis::{Fault, Injected, POISON_TOPIC},
    pipeline::{clients::Ledger, PipelineDb, TestBroker, TOPIC},
};

/// What the consumer logs when it dead-letters a message (`inbox::Consumer`).
const DEAD_LETTERED: &str = "dead-lettered a message";

/// Everything counted after a run. `failures` says which counts break the pipeline's promise.
#[derive(Debug, Default)]
pub struct Report {
    pub broker: &'static str,
    pub secs: u64,
    pub faults: BTreeMap<Fault, usize>,
    /// Connections of the consumers the database proxy turned away during its outages:
    /// proof that they tried to reach it.
    pub turned_away: usize,
    /// Payments the clients were told about (a 201 for both copies of their key).
    pub payments: usize,
    /// `payments` rows no client was told about.
    pub stray_payments: usize,
    pub receipts: i64,
    /// Payments with more than one receipt.
    pub doubles: usize,
    /// Payments with no receipt.
    pub lost: usize,
    /// Receipts of no payment a client was told about.
    pub stray_receipts: usize,
    /// `payment.created` rows never sent.
    pub unsent: i64,
    /// Poison rows planted, and how many of them are parked.
    pub planted: i64,
    pub parked: i64,
    /// Messages the consumers dead-lettered (their log lines; on RabbitMQ, or the dead-letter
    /// queue's count if higher).
    pub dead_lettered: usize,
    /// Processes that ended without being killed.
    pub exits: Vec<String>,
}

impl Report {
    /// What breaks the promise "every fault costs latency, never a lost or doubled effect":
    /// empty when the run passed. Parking is checked apart ([`Report::unparked`]): a
    /// library without parking still lets the rows after a poison row flow.
    pub fn failures(&self) -> Vec<String> {
        let mut failures = Vec::new();
        let mut fail = |n: usize, what: &str| {
            if n > 0 {
                failures.push(format!("{n} {what}"));
            }
        };
        fail(self.doubles, "payments with two receipts or more");
        fail(self.lost, "payments without a receipt");
        fail(self.stray_receipts, "receipts of no payment");
        fail(self.stray_payments, "payments no client was told about");
        fail(to_usize(self.unsent), "payment.created rows never sent");
        fail(self.dead_lettered, "messages dead-lettered");
        fail(self.exits.len(), "processes that gave up by themselves");
        if let Some(exits) = (!self.exits.is_empty()).then(|| self.exits.join("; ")) {
            failures.push(exits);
        }
        failures
    }

    /// Poison rows neither sent nor parked.
    pub fn unparked(&self) -> i64 {
        self.planted - self.parked
    }

    /// The table row of BENCHMARKS.md ("Pipeline faults").
    pub fn row(&self) -> String {
        let faults = self
            .faults
            .iter()
            .map(|(fault, n)| format!("{fault} {n}"))
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "| {} | {} s | {faults} | {} | {} | {} | {} | {} of {} | {} | {} | {} |",
            self.broker,
            self.secs,
            self.payments,
            self.receipts,
            self.doubles,
            self.lost,
            self.parked,
            self.planted,
            self.dead_lettered,
            self.unsent,
            self.exits.len()
        )
    }
}

fn to_usize(n: i64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// Waits (at most `limit`) until every payment in `created` has a receipt and no
/// `payment.created` row is unsent, then a little longer for a late double; then counts.
pub async fn check(
    ledger: &Ledger,
    broker: &TestBroker,
    fleet: &Fleet,
    created: &HashSet<String>,
    faults: &[Injected],
    limit: Duration,
) -> Report {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        let receipts = ledger.receipts().await;
        if created.iter().all(|p| receipts.contains_key(p)) && unsent(&ledger.pool).await == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    fleet.note_exits().await;

    let receipts = ledger.receipts().await;
    let mut faults_by_kind = BTreeMap::new();
    let mut turned_away = 0;
    for injected in faults {
        eprintln!(
            "pipeline-faults: {} ({}) for {:?}",
            injected.fault,
            injected.count,
            injected.ended - injected.started
        );
        *faults_by_kind.entry(injected.fault).or_default() += 1;
        if injected.fault == Fault::DatabaseOutage {
            turned_away += injected.count;
        }
    }
    let logged = fleet.logged(Role::Receipts, DEAD_LETTERED);
    let queued = match broker {
        TestBroker::Nats { .. } => 0,
        _ => usize::try_from(broker.leftovers().await).unwrap_or(0),
    };
    let paid: HashSet<String> = ledger.payments().await.into_iter().collect();
    Report {
        broker: broker.name(),
        faults: faults_by_kind,
        turned_away,
        payments: created.len(),
        stray_payments: paid.difference(created).count(),
        receipts: receipts.values().sum(),
        doubles: receipts.values().filter(|&&n| n > 1).count(),
        lost: created
            .iter()
            .filter(|p| !receipts.contains_key(*p))
            .count(),
        stray_receipts: receipts.keys().filter(|p| !created.contains(*p)).count(),
        unsent: unsent(&ledger.pool).await,
        planted: poison(&ledger.pool, "true").await,
        parked: if has_parking(&ledger.pool).await {
            poison(&ledger.pool, "parked_at IS NOT NULL").await
        } else {
            0
        },
        dead_lettered: logged.max(queued),
        exits: fleet.exits(),
        ..Report::default()
    }
}

/// `payment.created` rows not sent.
async fn unsent(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM tower_outbox WHERE sent_at IS NULL AND topic = $1")
        .bind(TOPIC)
        .fetch_one(pool)
        .await
        .expect("count unsent rows")
}

/// Poison rows matching `condition`.
async fn poison(pool: &PgPool, condition: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM tower_outbox WHERE topic = $1 AND {condition}"
    )))
    .bind(POISON_TOPIC)
    .fetch_one(pool)
    .await
    .expect("count poison rows")
}

/// Whether this library's outbox parks rows (it has the column).
async fn has_parking(pool: &PgPool) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM information_schema.columns
             WHERE table_schema = current_schema() AND table_name = 'tower_outbox'
               AND column_name = 'parked_at')",
    )
    .fetch_one(pool)
    .await
    .expect("look for the parked_at column")
}
