//! The history checker: what happened to each key, from the effects in the database and the
//! answers the clients got, and the one-line table row of a run.
//!
//! Per key:
//! - effects: its charge rows (found by its amount);
//! - double: two or more. In the separate mode a double while a process was killed, paused
//!   or cut from its store during the key's flight is the mode's documented limit (the
//!   effect committed, its record did not), counted apart as expected; any other double fails;
//! - lost: a 2xx answer whose payment has no charge row;
//! - stuck: a copy that ran out of patience, or a fresh copy after the run that got no final
//!   answer within its bound;
//! - differing: the two copies, or a copy and the fresh one, got different final answers.
//!   Part of the separate mode's documented double when each answer is one of the key's two
//!   runs (a paused owner, fenced when it resumes, still answers its own client with its own
//!   run): counted with that double as `answered apart`, not as a failure;
//! - refused: a final answer that is not a 2xx (a valid charge is never refused);
//! - outcome unknown: the `503 outcome-unknown` answers seen, with the final answer each such
//!   key's retries got.

use std::{
    collections::{BTreeMap, HashMap},
    fmt::Write as _,
    time::Instant,
};

use super::{
    clients::{Answer, KeyLog},
    effects::ChargeRow,
    nemesis::{Fault, Injected},
};

/// The verdict of one run.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub faults: BTreeMap<Fault, usize>,
    /// Store sessions the nemesis ended, in all.
    pub sessions_killed: usize,
    pub keys: usize,
    pub expected_doubles: usize,
    /// Of the expected doubles, those whose copies each got the answer of a different run.
    pub answered_apart: usize,
    pub doubles: usize,
    pub lost: usize,
    pub stuck: usize,
    pub differing: usize,
    pub refused: usize,
    pub outcome_unknown: usize,
    /// The final status of the keys that saw an outcome-unknown answer.
    pub unknown_then: BTreeMap<u16, usize>,
    /// One line per failing key, for the failure message.
    pub problems: Vec<String>,
}

/// Checks a run: `logs` per key, `fresh` the answer of each key's fresh copy after the run
/// (same order), `charges` the charge rows, `faults` what the nemesis did.
pub fn check(
    separate: bool,
    logs: &[KeyLog],
    fresh: &[Option<Answer>],
    charges: &[ChargeRow],
    faults: &[Injected],
) -> Report {
    let mut report = Report {
        keys: logs.len(),
        ..Report::default()
    };
    for fault in faults {
        *report.faults.entry(fault.fault).or_default() += 1;
        report.sessions_killed += fault.sessions;
    }
    let mut by_amount: HashMap<i64, Vec<&str>> = HashMap::new();
    for row in charges {
        by_amount
            .entry(row.amount)
            .or_default()
            .push(&row.payment_id);
    }
    for (log, fresh) in logs.iter().zip(fresh) {
        let effects = by_amount
            .get(&log.key.amount)
            .map_or(&[][..], Vec::as_slice);
        let problem = |report: &mut Report, what: &str| {
            report.problems.push(format!(
                "key {:?} (amount {}): {what}; effects {}, answers {:?}, fresh {:?}",
                log.key.charge.key,
                log.key.amount,
                effects.len(),
                log.copies
                    .iter()
                    .map(|c| c.answer.as_ref().map(brief))
                    .collect::<Vec<_>>(),
                fresh.as_ref().map(brief),
            ));
        };
        let documented = separate && effects.len() > 1 && disturbed(faults, log.started, log.ended);
        if effects.len() > 1 {
            if documented {
                report.expected_doubles += 1;
            } else {
                report.doubles += 1;
                problem(&mut report, "double");
            }
        }
        let answers: Vec<&Answer> = log
            .copies
            .iter()
            .filter_map(|c| c.answer.as_ref())
            .collect();
        if answers.len() < log.copies.len() || fresh.is_none() {
            report.stuck += 1;
            problem(&mut report, "stuck");
        }
        let all: Vec<&Answer> = answers.iter().copied().chain(fresh.as_ref()).collect();
        if all.windows(2).any(|pair| pair[0] != pair[1]) {
            let each_a_run = all.iter().all(|answer| {
                answer.status.is_success()
                    && payment_id(answer).is_some_and(|id| effects.contains(&id.as_str()))
            });
            if documented && each_a_run {
                report.answered_apart += 1;
            } else {
                report.differing += 1;
                problem(&mut report, "differing answers");
            }
        }
        if all.iter().any(|answer| !answer.status.is_success()) {
            report.refused += 1;
            problem(&mut report, "refused");
        }
        let lost = all.iter().any(|answer| {
            answer.status.is_success()
                && payment_id(answer).is_none_or(|id| !effects.contains(&id.as_str()))
        });
        if lost {
            report.lost += 1;
            problem(&mut report, "lost: answered 2xx without its charge row");
        }
        let unknown: usize = log.copies.iter().map(|c| c.outcome_unknown).sum();
        if unknown > 0 {
            report.outcome_unknown += unknown;
            if let Some(then) = all.first() {
                *report.unknown_then.entry(then.status.as_u16()).or_default() += 1;
            }
        }
    }
    report
}

/// Whether a fault overlapped `[started, ended]`: each kind the separate mode meets (a kill,
/// a pause past the lease, a cut from the store) can leave an effect without its record.
fn disturbed(faults: &[Injected], started: Instant, ended: Instant) -> bool {
    faults
        .iter()
        .any(|fault| fault.started <= ended && fault.ended >= started)
}

fn payment_id(answer: &Answer) -> Option<String> {
    let body: serde_json::Value = serde_json::from_slice(&answer.body).ok()?;
    Some(body["id"].as_str()?.to_owned())
}

fn brief(answer: &Answer) -> String {
    format!(
        "{} {}",
        answer.status.as_u16(),
        String::from_utf8_lossy(&answer.body)
    )
}

impl Report {
    /// Why the run fails; empty when it passes.
    pub fn failures(&self) -> Vec<String> {
        let mut failures = Vec::new();
        for (count, what) in [
            (self.doubles, "unexpected doubles"),
            (self.lost, "lost"),
            (self.stuck, "stuck"),
            (self.differing, "differing"),
            (self.refused, "refused"),
        ] {
            if count > 0 {
                failures.push(format!("{count} {what}"));
            }
        }
        failures
    }

    /// This run as one row of the table.
    pub fn row(&self, store: &str, mode: &str, seconds: u64) -> String {
        let mut faults = self
            .faults
            .iter()
            .map(|(fault, n)| format!("{fault} {n}"))
            .collect::<Vec<_>>()
            .join(", ");
        if self.sessions_killed > 0 {
            let _ = write!(faults, " ({} sessions ended)", self.sessions_killed);
        }
        let documented = if mode == "separate" {
            format!(
                "{} ({} answered apart)",
                self.expected_doubles, self.answered_apart
            )
        } else {
            "n/a".to_owned()
        };
        let then = self
            .unknown_then
            .iter()
            .map(|(status, n)| format!("{status} x{n}"))
            .collect::<Vec<_>>()
            .join(", ");
        let unknown = if then.is_empty() {
            self.outcome_unknown.to_string()
        } else {
            format!("{} ({then})", self.outcome_unknown)
        };
        format!(
            "| {store} | {mode} | {seconds} | {faults} | {} | {documented} | {} | {} | {} | {} | {unknown} |",
            self.keys, self.doubles, self.lost, self.stuck, self.differing
        )
    }
}
