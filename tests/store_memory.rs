//! The conformance suite against the in-memory store. Its byte budget is exercised in
//! `store_memory_budget.rs`.
//!
//! Each "instance" of the memory store is a clone of one shared store: clones share records,
//! as two layers in one process would.

mod conformance;

use std::sync::{Arc, OnceLock};

use tower_idempotency::store::MemoryStore;

fn shared() -> MemoryStore {
    static STORE: OnceLock<MemoryStore> = OnceLock::new();
    STORE.get_or_init(MemoryStore::new).clone()
}

async fn open() -> Option<conformance::DynStore> {
    Some(Arc::new(shared()))
}

async fn no_unreachable_memory_store() -> Option<conformance::DynStore> {
    None
}

conformance_tests!(open: open(), unreachable: no_unreachable_memory_store(), exact_purge_count: false);
