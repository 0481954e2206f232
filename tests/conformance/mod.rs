//! The store conformance suite (`tower_idempotency::conformance`, feature `conformance`), one
//! `#[tokio::test]` per check, for the in-tree stores.
//!
//! A backend's test file (`tests/store_<backend>.rs`) includes this module and invokes
//! [`conformance_tests!`] with an async expression that opens a NEW store instance (its own
//! pool/connection) onto the shared test database, or `None` when the backend is not
//! configured. Two calls of the expression give two independent "instances" sharing one
//! database.
#![allow(dead_code)]

#[path = "../common/backends.rs"]
mod backends;
#[allow(unused_imports)] // each test binary uses a different part
pub use backends::{reachable, require_all, url_or_skip};
#[allow(unused_imports)] // each test binary uses a different part
pub use tower_idempotency::conformance::*;

/// Generates one `#[tokio::test]` per conformance case. `$open` is an async expression giving
/// `Option<DynStore>` (a new instance each time; `None` skips). `$unreachable` is an async
/// expression giving a store pointed at a dead address, or `None` for backends without one.
#[macro_export]
macro_rules! conformance_tests {
    (open: $open:expr, unreachable: $unreachable:expr, exact_purge_count: $exact:expr) => {
        macro_rules! case {
            ($name:ident, $body:path) => {
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    if let Some(store) = $open.await {
                        $body(store).await;
                    }
                }
            };
        }
        case!(
            duplicate_claim_reports_in_progress_with_first_fingerprint,
            conformance::duplicate_claim_reports_in_progress_with_first_fingerprint
        );
        case!(
            claim_race_has_one_winner,
            conformance::claim_race_has_one_winner
        );
        case!(
            many_keys_race_one_winner_each,
            conformance::many_keys_race_one_winner_each
        );
        case!(
            expired_lease_is_taken_over_with_a_new_token,
            conformance::expired_lease_is_taken_over_with_a_new_token
        );
        case!(
            stale_token_changes_nothing,
            conformance::stale_token_changes_nothing
        );
        case!(unknown_token_is_stale, conformance::unknown_token_is_stale);
        case!(release_then_reclaim, conformance::release_then_reclaim);
        case!(
            forget_deletes_any_record_of_the_key,
            conformance::forget_deletes_any_record_of_the_key
        );
        case!(
            completed_payload_round_trips_byte_for_byte,
            conformance::completed_payload_round_trips_byte_for_byte
        );
        case!(
            renewed_lease_is_not_taken_over,
            conformance::renewed_lease_is_not_taken_over
        );
        case!(
            completed_record_expires_after_retention,
            conformance::completed_record_expires_after_retention
        );
        case!(
            scopes_do_not_share_keys,
            conformance::scopes_do_not_share_keys
        );
        case!(
            keys_with_unusual_characters_work,
            conformance::keys_with_unusual_characters_work
        );

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn purge_removes_only_expired_records() {
            if let Some(store) = $open.await {
                conformance::purge_removes_only_expired_records(store, $exact).await;
            }
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn two_instances_race_one_winner() {
            if let (Some(a), Some(b)) = ($open.await, $open.await) {
                conformance::two_instances_race_one_winner(a, b).await;
            }
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn unreachable_store_reports_backend_error() {
            let store: Option<conformance::DynStore> = $unreachable.await;
            if let Some(store) = store {
                conformance::unreachable_store_reports_backend_error(store).await;
            }
        }
    };
}
