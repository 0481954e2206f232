//! Where a request's cost goes in the layer on the memory store: allocations per request
//! (a counting global allocator) and a deterministic loop to run under callgrind.
//!
//! ```text
//! cargo bench --bench layer_profile                  # allocations per request, markdown table
//! target/release/deps/layer_profile-* run new-key 2000  # N requests of one kind (callgrind)
//! ```
//!
//! Kinds: `bare` (the same router without the layer), `new-key`, `replay`, `no-key`. The loop
//! runs on a current-thread runtime inside [`drive`], so
//! `valgrind --tool=callgrind --toggle-collect='*drive*'` counts only the requests.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::atomic::{AtomicU64, Ordering},
};

use axum::{body::Body, http::Request, routing::post, Router};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{store::MemoryStore, IdempotencyLayer};

/// Counts every allocation (and reallocation) made by the process.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static ALLOCATED_BYTES: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        ALLOCATED_BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        ALLOCATED_BYTES.fetch_add(new_size as u64, Ordering::Relaxed);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const BODY: &str = r#"{"amount":1200,"currency":"EUR"}"#;

async fn handler(body: axum::body::Bytes) -> (axum::http::StatusCode, String) {
    (
        axum::http::StatusCode::CREATED,
        format!(r#"{{"id":"pay_1","len":{}}}"#, body.len()),
    )
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Bare,
    NewKey,
    Replay,
    NoKey,
}

const KINDS: [(Kind, &str); 4] = [
    (Kind::Bare, "bare"),
    (Kind::NewKey, "new-key"),
    (Kind::Replay, "replay"),
    (Kind::NoKey, "no-key"),
];

/// The request of one kind; the key (if any) is built before the count starts.
fn request(key: Option<&str>) -> Request<Body> {
    let mut builder = Request::post("/payments").header("authorization", "Bearer bench");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder.body(Body::from(BODY)).unwrap()
}

struct Setup {
    runtime: tokio::runtime::Runtime,
    app: Router,
    keys: Vec<String>,
}

fn setup(kind: Kind, n: usize) -> Setup {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let router = Router::new().route("/payments", post(handler));
    let app = match kind {
        Kind::Bare => router,
        _ => router.layer(IdempotencyLayer::new(MemoryStore::new())),
    }
    // What `axum::serve` does once per connection: the handler becomes a route (and the
    // layer is applied to it) now, not again for every request.
    .with_state(());
    let keys = (0..n)
        .map(|i| match kind {
            Kind::NewKey => format!("key-{i}"),
            _ => "replayed".to_owned(),
        })
        .collect();
    // One request of each shape first: lazily built statics (tracing callsites, the
    // runtime's timer wheel, the store's first shard growth) are not per-request costs.
    runtime.block_on(async {
        for warm in ["warm-1", "warm-2", "replayed"] {
            let key = (kind != Kind::Bare && kind != Kind::NoKey).then_some(warm);
            call(&app, request(key)).await;
        }
    });
    Setup { runtime, app, keys }
}

async fn call(app: &Router, request: Request<Body>) {
    let response = app.clone().oneshot(request).await.unwrap();
    // Every kind is answered by the handler (or replays its 201): anything else means the
    // profile is of a rejection.
    assert_eq!(response.status(), axum::http::StatusCode::CREATED);
    let _ = response.into_body().collect().await.unwrap();
}

/// Runs one request per key: the part callgrind collects.
#[inline(never)]
fn drive(setup: &Setup, kind: Kind) {
    setup.runtime.block_on(async {
        for key in &setup.keys {
            let key = (kind != Kind::Bare && kind != Kind::NoKey).then_some(key.as_str());
            call(&setup.app, request(key)).await;
        }
    });
}

/// Allocations and allocated bytes per request of `kind`, over `n` requests.
fn allocations(kind: Kind, n: usize) -> (f64, f64) {
    let setup = setup(kind, n);
    let (count, bytes) = (
        ALLOCATIONS.load(Ordering::Relaxed),
        ALLOCATED_BYTES.load(Ordering::Relaxed),
    );
    drive(&setup, kind);
    let count = ALLOCATIONS.load(Ordering::Relaxed) - count;
    let bytes = ALLOCATED_BYTES.load(Ordering::Relaxed) - bytes;
    (count as f64 / n as f64, bytes as f64 / n as f64)
}

fn kind(name: &str) -> Kind {
    KINDS
        .iter()
        .find(|(_, n)| *n == name)
        .unwrap_or_else(|| panic!("unknown kind {name:?}: bare, new-key, replay or no-key"))
        .0
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["run", name, n] => {
            let kind = kind(name);
            let setup = setup(kind, n.parse().expect("a request count"));
            drive(&setup, kind);
        }
        [] => {
            const N: usize = 2000;
            println!("| request | allocations per request | bytes allocated per request |");
            println!("|---|---:|---:|");
            for (kind, name) in KINDS {
                let (count, bytes) = allocations(kind, N);
                println!("| {name} | {count:.1} | {bytes:.0} |");
            }
        }
        _ => panic!("usage: layer_profile [run bare|new-key|replay|no-key N]"),
    }
}
