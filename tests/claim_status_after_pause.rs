//! `ClaimStatus::is_lost()` right after the owner's process was paused for longer than its
//! lease (a GC pause, SIGSTOP, an overloaded host): the moment a handler resumes and checks
//! the status before its irreversible step. Found by the spin model (model/README.md,
//! finding 1, run `is-lost-after-pause`).
//!
//! It failed while the flag was set only by the renewal task, which has not run yet when the
//! handler resumes: the status said "held" although another request had taken the key over.
//! `is_lost()` now also compares this process' clock with the end of the last confirmed lease.

use std::{sync::Arc, time::Duration};

use tower_idempotency::{
    engine::Begin,
    store::{MemoryStore, Store},
    ClaimOutcome, Engine, Fingerprint, StoreKey,
};

const LEASE: Duration = Duration::from_millis(200);

#[tokio::test(flavor = "current_thread")]
async fn a_claim_paused_past_its_lease_and_taken_over_is_reported_lost() {
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::builder_shared(store.clone())
        .lease(LEASE)
        .store_timeout(LEASE / 6)
        .build()
        .expect("valid timings");
    let key = StoreKey::new("model", "paused-owner");
    let fingerprint = Fingerprint::of([b"charge".as_slice()]);
    let Begin::Run(claim) = engine.begin(key.clone(), fingerprint).await.unwrap() else {
        panic!("a new key must be claimed");
    };
    let status = claim.status();

    // The whole process stops: on this single-threaded runtime no task runs, the renewal
    // task included, while the store's clock goes on past the lease.
    std::thread::sleep(LEASE + LEASE / 2);

    // Another process takes the key over (the memory store answers without yielding, so the
    // paused owner's renewal task still has not run).
    let takeover = store
        .claim(&key, &fingerprint, LEASE)
        .await
        .expect("the store answers");
    assert!(
        matches!(takeover, ClaimOutcome::Claimed(_)),
        "the expired lease must be taken over: {takeover:?}"
    );

    // The owner resumes and checks before charging the card.
    assert!(
        status.is_lost(),
        "is_lost() says the claim is held although another request owns the key"
    );
    let _ = claim.release().await;
}
