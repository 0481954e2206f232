//! `MemoryVersioned` and `retry_on_conflict`: the same semantics as the SQL backends.

use std::{
    convert::Infallible,
    sync::{
        atomic::{AtomicU32, Ordering},
        Arc,
    },
    time::Duration,
};

use tokio::sync::Barrier;
use tower_idempotency::version::{
    retry_on_conflict, ConflictReason, Expected, InsertOutcome, MemoryVersioned, RetryPolicy,
    Version, VersionedUpdate,
};

#[derive(Debug, Clone, PartialEq)]
struct Payment {
    status: String,
    counter: u64,
}

fn payments() -> MemoryVersioned<u32, Payment> {
    let map = MemoryVersioned::new();
    let created = map.insert_new(
        1,
        Payment {
            status: "new".into(),
            counter: 0,
        },
    );
    assert_eq!(
        created,
        InsertOutcome::Created {
            version: Version::INITIAL
        }
    );
    map
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_updaters_exactly_one_wins() {
    const RACERS: usize = 32;
    let map = payments();
    let current = map.get(&1).unwrap();
    let barrier = Arc::new(Barrier::new(RACERS));
    let tasks: Vec<_> = (0..RACERS)
        .map(|racer| {
            let (map, barrier, current) = (map.clone(), barrier.clone(), current.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                map.update_if_version(&1, current.version, |p| {
                    p.counter = current.value.counter + 1;
                    p.status = format!("racer {racer}");
                })
            })
        })
        .collect();
    let (mut won, mut lost) = (0, 0);
    for task in tasks {
        match task.await.unwrap() {
            VersionedUpdate::Updated { version, .. } => {
                assert_eq!(version, Version::new(2));
                won += 1;
            }
            VersionedUpdate::Conflict {
                current_version,
                row,
                reason,
            } => {
                assert_eq!(current_version, Some(Version::new(2)));
                assert_eq!(row.unwrap().counter, 1);
                assert_eq!(reason, ConflictReason::VersionMismatch);
                lost += 1;
            }
            VersionedUpdate::NotFound => panic!("the row exists"),
        }
    }
    assert_eq!((won, lost), (1, RACERS - 1));
    let after = map.get(&1).unwrap();
    assert_eq!((after.version, after.value.counter), (Version::new(2), 1));
}

#[test]
fn deleted_row_is_not_found_and_create_only_insert_refuses_duplicates() {
    let map = payments();
    let again = map.insert_new(
        1,
        Payment {
            status: "dup".into(),
            counter: 9,
        },
    );
    assert!(matches!(again, InsertOutcome::AlreadyExists { .. }));
    assert_eq!(map.get(&1).unwrap().value.status, "new");
    map.remove(&1);
    assert_eq!(
        map.update_if_version(&1, Version::INITIAL, |p| p.counter += 1),
        VersionedUpdate::NotFound
    );
    assert_eq!(
        map.update_if_version(&7, Expected::any(), |_| {}),
        VersionedUpdate::NotFound
    );
    assert!(map.is_empty());
}

#[test]
fn expectations_and_no_op_updates() {
    let map = payments();
    // Same values: still an update, the version moves.
    assert!(map
        .update_if_version(&1, Version::INITIAL, |_| {})
        .is_updated());
    assert!(map
        .update_if_version(
            &1,
            Expected::one_of([Version::new(5), Version::new(2)]),
            |_| {}
        )
        .is_updated());
    assert!(map
        .update_if_version(&1, Expected::nothing(), |_| {})
        .is_conflict());
    assert!(map
        .update_if_version(&1, Expected::any().excluding([Version::new(3)]), |_| {})
        .is_conflict());
    assert_eq!(map.get(&1).unwrap().version, Version::new(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retry_on_conflict_rereads_until_every_increment_lands() {
    const WRITERS: u64 = 16;
    let map = payments();
    let policy = RetryPolicy::default()
        .max_attempts(500)
        .base_delay(Duration::from_micros(200))
        .max_delay(Duration::from_millis(5));
    let barrier = Arc::new(Barrier::new(WRITERS as usize));
    let tasks: Vec<_> = (0..WRITERS)
        .map(|_| {
            let (map, barrier, policy) = (map.clone(), barrier.clone(), policy.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                retry_on_conflict(&policy, || async {
                    let current = map.get(&1).unwrap();
                    // Widen the window between read and write so that writers do collide.
                    tokio::task::yield_now().await;
                    Ok::<_, Infallible>(map.update_if_version(&1, current.version, |p| {
                        p.counter = current.value.counter + 1;
                    }))
                })
                .await
                .unwrap()
            })
        })
        .collect();
    for task in tasks {
        assert!(task.await.unwrap().is_updated());
    }
    let after = map.get(&1).unwrap();
    assert_eq!(after.value.counter, WRITERS);
    assert_eq!(after.version, Version::new(1 + WRITERS as i64));
}

#[tokio::test]
async fn retry_on_conflict_gives_up_with_the_last_conflict() {
    let map = payments();
    let _ = map.update_if_version(&1, Version::INITIAL, |_| {});
    let attempts = AtomicU32::new(0);
    let policy = RetryPolicy::default()
        .max_attempts(4)
        .base_delay(Duration::from_millis(1));
    let outcome = retry_on_conflict(&policy, || async {
        attempts.fetch_add(1, Ordering::SeqCst);
        // Always the stale version: can never win.
        Ok::<_, Infallible>(map.update_if_version(&1, Version::INITIAL, |_| {}))
    })
    .await
    .unwrap();
    assert_eq!(attempts.load(Ordering::SeqCst), 4);
    assert_eq!(outcome.version(), Some(Version::new(2)));
    assert!(outcome.is_conflict());
}

#[tokio::test]
async fn retry_on_conflict_never_retries_errors_or_not_found() {
    let attempts = AtomicU32::new(0);
    let outcome: Result<VersionedUpdate, &str> =
        retry_on_conflict(&RetryPolicy::default(), || async {
            attempts.fetch_add(1, Ordering::SeqCst);
            Err("database unreachable")
        })
        .await;
    assert_eq!(outcome, Err("database unreachable"));
    assert_eq!(attempts.load(Ordering::SeqCst), 1);
    let outcome: VersionedUpdate = retry_on_conflict(&RetryPolicy::default(), || async {
        attempts.fetch_add(1, Ordering::SeqCst);
        VersionedUpdate::NotFound
    })
    .await;
    assert_eq!(outcome, VersionedUpdate::NotFound);
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
}
