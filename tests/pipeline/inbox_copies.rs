//! Copies of one message racing through an inbox claim, each handled the way a consumer
//! handles a delivery: the same race on every inbox table.

use std::{future::Future, pin::Pin, sync::Arc, time::Duration};

use tokio::sync::Barrier;
use tower_idempotency::inbox::{InboxClaim, InboxStore};

/// The connection type of an inbox's database.
pub type Connection<S> = <<S as InboxStore>::Database as sqlx::Database>::Connection;

/// Writes the message's one effect inside the claim's transaction.
pub type Effect<S> =
    for<'a> fn(&'a mut Connection<S>, &'a str) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// How one copy ended: its last claim, and how often it found the message busy before that.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOutcome {
    pub claim: InboxClaim,
    pub busy: u32,
}

/// Releases `copies` copies of message `id` at once (a barrier). Each claims in its own
/// transaction; the winner writes `effect` and holds its transaction for `hold` before
/// committing, so the others meet it in flight; a busy copy rolls back and looks again.
pub async fn race_copies<S: InboxStore>(
    inbox: &S,
    id: &str,
    copies: usize,
    effect: Effect<S>,
    hold: Duration,
) -> Vec<CopyOutcome>
where
    Connection<S>: Send,
{
    let barrier = Arc::new(Barrier::new(copies));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..copies {
        let (inbox, barrier, id) = (inbox.clone(), barrier.clone(), id.to_owned());
        tasks.spawn(async move {
            barrier.wait().await;
            let mut busy = 0;
            loop {
                let mut tx = inbox.pool().begin().await.expect("begin");
                let claim = inbox.claim(&mut tx, "receipts", &id).await.expect("claim");
                match claim {
                    InboxClaim::New => {
                        effect(&mut tx, &id).await;
                        tokio::time::sleep(hold).await;
                        tx.commit().await.expect("commit");
                        return CopyOutcome { claim, busy };
                    }
                    InboxClaim::Duplicate => return CopyOutcome { claim, busy },
                    InboxClaim::Busy => {
                        busy += 1;
                        drop(tx);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }
        });
    }
    let outcomes = tasks.join_all().await;
    let new = outcomes
        .iter()
        .filter(|o| o.claim == InboxClaim::New)
        .count();
    assert_eq!(
        new, 1,
        "copies that claimed the message as new: {outcomes:?}"
    );
    outcomes
}
