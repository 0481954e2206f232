//! The floor comparison in process (issue 36): the JSON charge service of `examples/floor`
//! bare, behind the floor (the least any idempotency layer must do) and behind the library's
//! layer on the memory store, for a new key and a replay. No sockets.
//!
//! ```text
//! cargo bench --bench floor                        # criterion, times per request
//! target/release/deps/floor-* run layer new-key 2000  # N requests of one kind (callgrind)
//! ```
//!
//! `run SUBJECT KIND N` (SUBJECT: bare, floor, layer; KIND: new-key, replay) sends N requests
//! inside [`drive`] on a current-thread runtime, so
//! `valgrind --tool=callgrind --toggle-collect=floor::drive` counts only the requests.

#[path = "../examples/floor/app.rs"]
mod app;
#[path = "../examples/floor/floor_layer.rs"]
mod floor_layer;

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use app::Subject;
use axum::{body::Body, http::Request, Router};
use criterion::Criterion;
use http_body_util::BodyExt;
use tower::ServiceExt;

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    NewKey,
    Replay,
}

fn request(key: &str) -> Request<Body> {
    Request::post("/payments")
        .header("authorization", "Bearer bench")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Body::from(app::BODY))
        .unwrap()
}

/// Sends one request and reads the whole answer, a 201 (the handler's or its replay): a
/// bench that timed refusals would report the wrong path's cost.
async fn call(app: &Router, key: &str) {
    let response = app.clone().oneshot(request(key)).await.unwrap();
    assert_eq!(
        response.status(),
        axum::http::StatusCode::CREATED,
        "the bench measured the wrong path"
    );
    let _ = response.into_body().collect().await.unwrap();
}

fn router(subject: Subject) -> Router {
    app::router(subject, Arc::new(AtomicU64::new(0)))
}

/// Criterion: every subject, new key and replay, on a two-worker runtime.
fn criterion_benches(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let counter = AtomicU64::new(0);
    let mut group = c.benchmark_group("floor");
    group
        .measurement_time(Duration::from_secs(3))
        .sample_size(50);
    for subject in Subject::ALL {
        let app = router(subject);
        let name = subject.name();
        let kinds: &[Kind] = match subject {
            Subject::Bare => &[Kind::NewKey],
            _ => &[Kind::NewKey, Kind::Replay],
        };
        for &kind in kinds {
            let label = match (subject, kind) {
                (Subject::Bare, _) => name.to_owned(),
                (_, Kind::NewKey) => format!("{name}, new key"),
                (_, Kind::Replay) => format!("{name}, replay"),
            };
            if kind == Kind::Replay {
                runtime.block_on(call(&app, "replayed"));
            }
            group.bench_function(label, |b| {
                b.to_async(&runtime).iter(|| {
                    let key = match kind {
                        Kind::NewKey => format!("key-{}", counter.fetch_add(1, Ordering::Relaxed)),
                        Kind::Replay => "replayed".to_owned(),
                    };
                    let app = &app;
                    async move { call(app, &key).await }
                })
            });
        }
    }
    group.finish();
}

struct Setup {
    runtime: tokio::runtime::Runtime,
    app: Router,
    keys: Vec<String>,
}

fn setup(subject: Subject, kind: Kind, n: usize) -> Setup {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let app = router(subject);
    let keys = (0..n)
        .map(|i| match kind {
            Kind::NewKey => format!("key-{i}"),
            Kind::Replay => "replayed".to_owned(),
        })
        .collect();
    // One request of each shape first: lazily built statics (tracing callsites, the
    // runtime's timer wheel, the maps' first growth) are not per-request costs.
    runtime.block_on(async {
        for warm in ["warm-1", "warm-2", "replayed"] {
            call(&app, warm).await;
        }
    });
    Setup { runtime, app, keys }
}

/// Runs one request per key: the part callgrind collects.
#[inline(never)]
fn drive(setup: &Setup) {
    setup.runtime.block_on(async {
        for key in &setup.keys {
            call(&setup.app, key).await;
        }
    });
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let ["run", subject, kind, n] = args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        let subject = Subject::named(subject).expect("a subject: bare, floor or layer");
        let kind = match kind {
            "new-key" => Kind::NewKey,
            "replay" => Kind::Replay,
            other => panic!("unknown kind {other:?}: new-key or replay"),
        };
        let setup = setup(subject, kind, n.parse().expect("a request count"));
        drive(&setup);
        return;
    }
    let mut criterion = Criterion::default().configure_from_args();
    criterion_benches(&mut criterion);
    criterion.final_summary();
}
