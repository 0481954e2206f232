//! Streaming and trailer-bearing responses (issue 9, item 10): the first caller gets frames as
//! the handler produces them (nothing buffered before the first byte) and the trailers; what
//! was sent is recorded when the body ends, so duplicates replay the same bytes and trailers.

mod common;

use std::{
    convert::Infallible,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    body::Body,
    extract::State,
    http::{HeaderMap, HeaderValue, Request, StatusCode},
    response::Response,
    routing::post,
    Router,
};
use bytes::Bytes;
use common::{layer_with, Runs};
use http_body::{Body as _, Frame};
use http_body_util::{BodyExt, StreamBody};
use tokio::sync::mpsc;
use tower::ServiceExt;
use tower_idempotency::{store::MemoryStore, InProgressPolicy};

/// The sending end of one streamed response body.
type Feed = mpsc::UnboundedSender<Result<Frame<Bytes>, Infallible>>;

/// The handler's side of each streamed response, handed to the test.
type Feeds = Arc<Mutex<mpsc::UnboundedSender<Feed>>>;

/// `POST /stream`: counts a run and answers 200 with a body whose frames the test sends.
/// `POST /grpc`: counts a run and answers two data frames then a `grpc-status: 0` trailer.
/// `POST /whole`: counts a run and answers a body of known length in one frame.
fn app(runs: Runs, feeds: Feeds) -> Router {
    let layer = layer_with(MemoryStore::new(), |e| {
        e.in_progress(InProgressPolicy::Reject)
    });
    Router::new()
        .route("/stream", post(stream))
        .route("/grpc", post(grpc))
        .route(
            "/whole",
            post(|State((runs, _)): State<(Runs, Feeds)>| async move {
                runs.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                "the whole answer"
            }),
        )
        .with_state((runs, feeds))
        .layer(layer)
}

async fn stream(State((runs, feeds)): State<(Runs, Feeds)>) -> Response {
    runs.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let (tx, rx) = mpsc::unbounded_channel();
    feeds.lock().unwrap().send(tx).unwrap();
    let frames = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|frame| (frame, rx))
    });
    Response::new(Body::new(StreamBody::new(frames)))
}

async fn grpc(State((runs, _)): State<(Runs, Feeds)>) -> Response {
    runs.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let trailers = HeaderMap::from_iter([(
        axum::http::HeaderName::from_static("grpc-status"),
        HeaderValue::from_static("0"),
    )]);
    let frames = [
        Frame::data(Bytes::from_static(b"msg-1")),
        Frame::data(Bytes::from_static(b"msg-2")),
        Frame::trailers(trailers),
    ];
    let body = StreamBody::new(futures_util::stream::iter(frames.map(Ok::<_, Infallible>)));
    Response::new(Body::new(body))
}

fn request(uri: &str) -> Request<Body> {
    Request::post(uri)
        .header("authorization", "Bearer alice")
        .header("idempotency-key", "k")
        .body(Body::empty())
        .unwrap()
}

fn setup() -> (Router, Runs, mpsc::UnboundedReceiver<Feed>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let runs = Runs::default();
    (app(runs.clone(), Arc::new(Mutex::new(tx))), runs, rx)
}

const LIMIT: Duration = Duration::from_secs(5);

/// Sends `/stream`, feeds it `first`, and returns the feed and the response, which must come
/// while the body is still open.
async fn open_stream(
    app: &Router,
    feeds: &mut mpsc::UnboundedReceiver<Feed>,
    first: &'static [u8],
) -> (Feed, Response) {
    let response = tokio::spawn(app.clone().oneshot(request("/stream")));
    let feed = feeds.recv().await.unwrap();
    feed.send(Ok(Frame::data(Bytes::from_static(first))))
        .unwrap();
    let response = tokio::time::timeout(LIMIT, response)
        .await
        .expect("the response waited for the end of its body")
        .unwrap()
        .unwrap();
    (feed, response)
}

/// The first caller reads the first frame while the handler has not produced the second: the
/// layer does not wait for the end of the body. Once it ends, a duplicate replays it whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_response_reaches_the_first_caller_before_it_ends() {
    let (app, runs, mut feeds) = setup();
    let (feed, response) = open_stream(&app, &mut feeds, b"event: 1\n\n").await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let first = tokio::time::timeout(LIMIT, body.frame())
        .await
        .expect("the first frame was held back")
        .unwrap()
        .unwrap();
    assert_eq!(first.into_data().unwrap(), "event: 1\n\n");
    feed.send(Ok(Frame::data(Bytes::from_static(b"event: 2\n\n"))))
        .unwrap();
    drop(feed);
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(rest, "event: 2\n\n");

    let replay = app.oneshot(request("/stream")).await.unwrap();
    assert_eq!(replay.status(), StatusCode::OK);
    let replayed = replay.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(replayed, "event: 1\n\nevent: 2\n\n");
    assert_eq!(runs.count(), 1);
}

/// A body that knows its end (here one frame of known length) ends with its last data frame:
/// hyper writes it and drops the body without polling again. So the outcome is recorded before
/// that frame is handed out, and a retry sent the moment the caller has the last byte replays
/// it. The runtime is single-threaded and nothing yields in between, so no background task
/// could have recorded it instead (with `InProgressPolicy::Reject`, a record still in progress
/// would answer 409).
#[tokio::test]
async fn a_body_of_known_length_is_recorded_before_its_last_frame_is_handed_out() {
    let (app, runs, _feeds) = setup();
    let response = app.clone().oneshot(request("/whole")).await.unwrap();
    let mut body = response.into_body();
    let only = body.frame().await.unwrap().unwrap();
    assert_eq!(only.into_data().unwrap(), "the whole answer");
    assert!(
        body.is_end_stream(),
        "after the last frame the body must say it ended, or hyper reads on"
    );
    drop(body);

    let replay = app.oneshot(request("/whole")).await.unwrap();
    assert_eq!(
        replay.status(),
        StatusCode::OK,
        "the outcome was not recorded yet"
    );
    let replayed = replay.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(replayed, "the whole answer");
    assert_eq!(runs.count(), 1);
}

/// Trailers reach the first caller, and are stored and replayed to duplicates.
#[tokio::test]
async fn trailers_pass_through_and_are_replayed() {
    let (app, runs, _feeds) = setup();
    for _ in 0..2 {
        let response = app.clone().oneshot(request("/grpc")).await.unwrap();
        let collected = response.into_body().collect().await.unwrap();
        let trailers = collected.trailers().cloned().expect("trailers dropped");
        assert_eq!(trailers["grpc-status"], "0");
        assert_eq!(collected.to_bytes(), "msg-1msg-2");
    }
    assert_eq!(runs.count(), 1);
}

/// The client leaves mid-body: the rest is read in the background and recorded, so the
/// retry replays the whole response instead of running the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_dropped_mid_stream_is_still_recorded() {
    let (app, runs, mut feeds) = setup();
    let (feed, response) = open_stream(&app, &mut feeds, b"part 1;").await;
    let mut body = response.into_body();
    body.frame().await.unwrap().unwrap();
    drop(body);
    feed.send(Ok(Frame::data(Bytes::from_static(b"part 2"))))
        .unwrap();
    drop(feed);
    let replayed = tokio::time::timeout(LIMIT, async {
        loop {
            let answer = app.clone().oneshot(request("/stream")).await.unwrap();
            if answer.status() == StatusCode::OK {
                return answer.into_body().collect().await.unwrap().to_bytes();
            }
            // 409 while the rest is still being recorded.
            assert_eq!(answer.status(), StatusCode::CONFLICT);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the outcome was never recorded");
    assert_eq!(replayed, "part 1;part 2");
    assert_eq!(runs.count(), 1);
}

/// Clients that hang up right after the headers of an endless stream (server-sent events,
/// say): the rest of each body is read in the background under the same limits as a detached
/// handler. At most `max` such drains hold their claims at once (the others are dropped at
/// the hang-up, their keys released), and each ends `lifetime` after its request arrived,
/// not after the hang-up, releasing its key. Virtual time: the handler takes 6 s before its
/// headers, the lifetime is 10 s, so a drain ends at 10 s, not at 16 s.
#[tokio::test(start_paused = true)]
async fn streams_abandoned_after_their_headers_obey_the_detach_limits() {
    let runs = Runs::default();
    let layer = layer_with(MemoryStore::new(), |e| e).detach_limits(2, Duration::from_secs(10));
    let engine = layer.engine().clone();
    let events = |State(runs): State<Runs>| async move {
        runs.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(6)).await;
        let ticks = futures_util::stream::unfold(0u64, |n| async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let frame = Frame::data(Bytes::from(format!("data: {n}\n\n")));
            Some((Ok::<_, Infallible>(frame), n + 1))
        });
        Response::new(Body::new(StreamBody::new(ticks)))
    };
    let app = Router::new()
        .route("/events", post(events))
        .with_state(runs.clone())
        .layer(layer);
    let keyed = |key: String| {
        Request::post("/events")
            .header("authorization", "Bearer alice")
            .header("idempotency-key", key)
            .body(Body::empty())
            .unwrap()
    };
    let arrived = tokio::time::Instant::now();
    let clients: Vec<_> = (0..8)
        .map(|i| tokio::spawn(app.clone().oneshot(keyed(format!("sse-{i}")))))
        .collect();
    for client in clients {
        let response = client.await.unwrap().unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        // The client hangs up after the headers.
        drop(response);
    }
    assert_eq!(runs.count(), 8);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        engine.in_flight(),
        2,
        "claims held by abandoned streams beyond the detach limit"
    );

    tokio::time::sleep_until(arrived + Duration::from_millis(10_100)).await;
    assert_eq!(
        engine.in_flight(),
        0,
        "an abandoned stream outlived its request's lifetime"
    );
    // Every key was released: each retry runs again.
    for i in 0..8 {
        let response = app
            .clone()
            .oneshot(keyed(format!("sse-{i}")))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    assert_eq!(runs.count(), 16);
}
