//! gRPC-web behind the layer, and streams whose status comes last: a tonic server with
//! tonic-web's `GrpcWebLayer` inside the idempotency layer, so the layer sees gRPC-web calls
//! (`application/grpc-web`, `-text`) whose status travels in the body's trailer frame, called
//! by tonic's own gRPC-web client (and by hand for the base64 `-text` form). Effects are rows
//! in PostgreSQL, written on the call's transaction in the transactional mode.
//!
//! - A call's status decides store or release exactly as for gRPC, in both modes: a success
//!   is replayed and charged once, a status a retry may cure releases the key (separate
//!   mode) or rolls its writes back (transactional mode).
//! - A server stream over the response limit in the transactional mode: its status is known
//!   only at its end, so the commit waits for it. A stream that ends with `UNAVAILABLE` or
//!   `INTERNAL` keeps no writes, and its retry runs again.

#[path = "common/backends.rs"]
mod backends;
#[path = "common/effects_table.rs"]
mod effects_table;
#[path = "common/grpc_metadata.rs"]
mod grpc_metadata;
#[path = "common/grpc_service.rs"]
mod grpc_service;
#[path = "common/pg_effects.rs"]
mod pg_effects;

use std::{
    collections::VecDeque,
    net::SocketAddr,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
};

use base64::Engine as _;
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use grpc_metadata::comparable_metadata;
use grpc_service::{BoxFuture, Handwritten};
use http::uri::PathAndQuery;
use http_body_util::BodyExt;
use tonic::{Code, Request, Response, Status};
use tonic_prost::ProstCodec;
use tower::ServiceBuilder;
use tower_idempotency::{
    store::PostgresStore,
    transactional::{Transactional, TxSlot},
    IdempotencyLayer, StoreKey, Token,
};

#[derive(Clone, PartialEq, prost::Message)]
struct ChargeRequest {
    #[prost(int64, tag = "1")]
    amount: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ChargeReply {
    #[prost(string, tag = "1")]
    charge_id: String,
}

/// `/test.Payments/Charge` (unary) and `/test.Payments/Report` (a server stream of
/// [`REPORT_MESSAGES`] messages of [`REPORT_MESSAGE_BYTES`]), each writing one effect row
/// for its call's key, on the call's transaction when there is one. Each call ends with the
/// next code of `endings` (`OK` when it is empty).
#[derive(Clone)]
struct Payments {
    store: PostgresStore,
    table: Arc<str>,
    attempts: Arc<AtomicUsize>,
    endings: Arc<Mutex<VecDeque<Code>>>,
    /// The next report keeps its transaction (a task it spawned holds it) past its answer.
    hold_transaction: Arc<AtomicBool>,
}

const REPORT_MESSAGES: usize = 8;
const REPORT_MESSAGE_BYTES: usize = 512;
/// The layer's response limit in these tests: a report (4 KiB) is over it.
const RESPONSE_LIMIT: usize = 1024;

impl Payments {
    /// Writes the call's effect row, and says how the call ends.
    async fn charge<T>(&self, request: &Request<T>) -> Result<(), Status> {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        let key = request
            .metadata()
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("(unkeyed)")
            .to_owned();
        let insert = format!("INSERT INTO {} (k) VALUES ($1)", self.table);
        let insert = sqlx::query(sqlx::AssertSqlSafe(insert)).bind(key);
        let written = match request.extensions().get::<TxSlot<sqlx::Postgres>>() {
            Some(slot) => {
                let mut tx = slot
                    .lock()
                    .await
                    .map_err(|e| Status::internal(e.to_string()))?;
                insert.execute(&mut *tx).await
            }
            None => insert.execute(self.store.pool()).await,
        };
        written.map_err(|e| Status::internal(e.to_string()))?;
        Ok(())
    }

    fn ending(&self) -> Code {
        self.endings.lock().unwrap().pop_front().unwrap_or(Code::Ok)
    }

    async fn effects(&self, key: &str) -> i64 {
        let key = StoreKey::new("unused", key);
        pg_effects::effects(&self.store, &self.table, &key).await
    }
}

impl Payments {
    /// The service tonic serves: its two methods.
    fn service(&self) -> Handwritten {
        let payments = self.clone();
        Handwritten(Arc::new(move |request| {
            let payments = payments.clone();
            Box::pin(async move {
                let codec = ProstCodec::<ChargeReply, ChargeRequest>::default();
                let mut grpc = tonic::server::Grpc::new(codec);
                match request.uri().path() {
                    "/test.Payments/Report" => {
                        grpc.server_streaming(Report(payments), request).await
                    }
                    _ => grpc.unary(Charge(payments), request).await,
                }
            })
        }))
    }
}

struct Charge(Payments);

impl tonic::server::UnaryService<ChargeRequest> for Charge {
    type Response = ChargeReply;
    type Future = BoxFuture<Result<Response<ChargeReply>, Status>>;

    fn call(&mut self, request: Request<ChargeRequest>) -> Self::Future {
        let payments = self.0.clone();
        Box::pin(async move {
            payments.charge(&request).await?;
            match payments.ending() {
                Code::Ok => Ok(Response::new(ChargeReply {
                    charge_id: format!("ch_{}", Token::random().to_hex()),
                })),
                code => Err(Status::new(code, "the bank is down")),
            }
        })
    }
}

struct Report(Payments);

type Replies = Pin<Box<dyn Stream<Item = Result<ChargeReply, Status>> + Send>>;

impl tonic::server::ServerStreamingService<ChargeRequest> for Report {
    type Response = ChargeReply;
    type ResponseStream = Replies;
    type Future = BoxFuture<Result<Response<Replies>, Status>>;

    fn call(&mut self, request: Request<ChargeRequest>) -> Self::Future {
        let payments = self.0.clone();
        Box::pin(async move {
            payments.charge(&request).await?;
            if payments.hold_transaction.swap(false, Ordering::SeqCst) {
                let slot = request
                    .extensions()
                    .get::<TxSlot<sqlx::Postgres>>()
                    .cloned();
                let slot = slot.expect("the transactional mode");
                let (held, holding) = tokio::sync::oneshot::channel();
                tokio::spawn(async move {
                    let _guard = slot.lock().await.expect("the transaction");
                    held.send(()).unwrap();
                    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
                });
                holding.await.unwrap();
            }
            let line = ChargeReply {
                charge_id: "x".repeat(REPORT_MESSAGE_BYTES),
            };
            let lines = futures_util::stream::iter(vec![Ok(line); REPORT_MESSAGES]);
            // The status comes after every message, as a stream that fails at its end would.
            let end = match payments.ending() {
                Code::Ok => None,
                code => Some(Err(Status::new(code, "the ledger went away"))),
            };
            let replies: Replies = Box::pin(lines.chain(futures_util::stream::iter(end)));
            Ok(Response::new(replies))
        })
    }
}

/// Serves `payments` over HTTP/1.1 and HTTP/2 with tonic-web translating inside `layer`.
async fn serve(layer: IdempotencyLayer, payments: Payments) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // tonic's request body is not `From<Bytes>`, which the layer needs: mapped to axum's.
    let idempotency = ServiceBuilder::new()
        .map_request(|r: http::Request<tonic::body::Body>| r.map(axum::body::Body::new))
        .layer(layer.max_response_body(RESPONSE_LIMIT));
    let server = tonic::transport::Server::builder()
        .accept_http1(true)
        .layer(idempotency)
        .layer(tonic_web::GrpcWebLayer::new())
        .add_service(payments.service())
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(server);
    addr
}

async fn setup(
    layer: impl FnOnce(PostgresStore) -> IdempotencyLayer,
) -> Option<(SocketAddr, Payments)> {
    let (store, table) = pg_effects::store_and_table(8, "grpc_web_effects").await?;
    let payments = Payments {
        store: store.clone(),
        table: table.into(),
        attempts: Arc::default(),
        endings: Arc::default(),
        hold_transaction: Arc::default(),
    };
    let addr = serve(layer(store), payments.clone()).await;
    Some((addr, payments))
}

fn separate(store: PostgresStore) -> IdempotencyLayer {
    IdempotencyLayer::new(store)
}

fn transactional(store: PostgresStore) -> IdempotencyLayer {
    IdempotencyLayer::transactional(Transactional::new(store))
}

/// tonic's own gRPC-web client (`application/grpc-web`, HTTP/1.1).
fn web_client(
    addr: SocketAddr,
) -> tonic::client::Grpc<
    impl tonic::client::GrpcService<
            tonic::body::Body,
            ResponseBody = tonic_web::GrpcWebCall<hyper::body::Incoming>,
            Error = hyper_util::client::legacy::Error,
        > + Clone,
> {
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http();
    let service = ServiceBuilder::new()
        .layer(tonic_web::GrpcWebClientLayer::new())
        .service(http);
    tonic::client::Grpc::with_origin(service, format!("http://{addr}").parse().unwrap())
}

fn keyed<T>(message: T, key: &str) -> Request<T> {
    let mut request = Request::new(message);
    let metadata = request.metadata_mut();
    metadata.insert("authorization", "Bearer alice".parse().unwrap());
    metadata.insert("idempotency-key", key.parse().unwrap());
    request
}

/// One unary gRPC-web call: the reply and its metadata (minus `date`), or its status.
async fn charge(
    addr: SocketAddr,
    key: &str,
) -> Result<(ChargeReply, Vec<(String, String)>), Status> {
    let mut client = web_client(addr);
    client.ready().await.unwrap();
    let reply = client
        .unary(
            keyed(ChargeRequest { amount: 1200 }, key),
            PathAndQuery::from_static("/test.Payments/Charge"),
            ProstCodec::<ChargeRequest, ChargeReply>::default(),
        )
        .await?;
    // HTTP/1.1 framing is the connection's: a streamed answer is chunked, its replay sized.
    let framing = ["content-length", "transfer-encoding"];
    let mut metadata = comparable_metadata(reply.metadata());
    metadata.retain(|(name, _)| !framing.contains(&name.as_str()));
    Ok((reply.into_inner(), metadata))
}

/// One server-streaming gRPC-web call, read to its end: how many messages came, and its
/// status.
async fn report(addr: SocketAddr, key: &str) -> (usize, Code) {
    report_on(web_client(addr), key).await
}

/// The same server stream over plain gRPC (HTTP/2, trailers).
async fn grpc_report(addr: SocketAddr, key: &str) -> (usize, Code) {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    report_on(tonic::client::Grpc::new(channel), key).await
}

/// A report called on `client`: how many messages came before it ended, and the status it
/// ended with.
async fn report_on<T>(mut client: tonic::client::Grpc<T>, key: &str) -> (usize, Code)
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::ResponseBody: http_body::Body<Data = Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error:
        Into<Box<dyn std::error::Error + Send + Sync>> + Send,
    T::Error: std::fmt::Debug,
{
    client.ready().await.unwrap();
    let call = client
        .server_streaming(
            keyed(ChargeRequest { amount: 1200 }, key),
            PathAndQuery::from_static("/test.Payments/Report"),
            ProstCodec::<ChargeRequest, ChargeReply>::default(),
        )
        .await;
    let mut stream = match call {
        Ok(response) => response.into_inner(),
        Err(status) => return (0, status.code()),
    };
    let mut messages = 0;
    loop {
        match stream.message().await {
            Ok(Some(_)) => messages += 1,
            Ok(None) => return (messages, Code::Ok),
            Err(status) => return (messages, status.code()),
        }
    }
}

fn key(name: &str) -> String {
    format!("{name}-{}", Token::random().to_hex())
}

/// In both modes: a success is stored and replayed (one charge), a status a retry may cure
/// is not (its charge released or rolled back), whatever the client does next.
async fn a_web_call_is_stored_or_released_by_its_status(
    layer: fn(PostgresStore) -> IdempotencyLayer,
    kept_after_failure: i64,
) {
    let Some((addr, payments)) = setup(layer).await else {
        return;
    };
    let k = key("web");
    let first = charge(addr, &k).await.expect("the call succeeds");
    assert!(
        first
            .1
            .contains(&("grpc-status".to_owned(), "0".to_owned())),
        "{:?}",
        first.1
    );
    let again = charge(addr, &k).await.expect("the retry is answered");
    assert_eq!(
        again, first,
        "the retry replays the reply, trailers included"
    );
    assert_eq!(payments.attempts.load(Ordering::SeqCst), 1, "ran once");
    assert_eq!(payments.effects(&k).await, 1, "one charge in the database");

    let k = key("web-unavailable");
    payments
        .endings
        .lock()
        .unwrap()
        .push_back(Code::Unavailable);
    let failed = charge(addr, &k).await.unwrap_err();
    assert_eq!(failed.code(), Code::Unavailable, "{failed:?}");
    assert_eq!(payments.effects(&k).await, kept_after_failure);
    charge(addr, &k).await.expect("the retry runs");
    assert_eq!(payments.attempts.load(Ordering::SeqCst), 3);
    assert_eq!(payments.effects(&k).await, kept_after_failure + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_mode_stores_or_releases_a_grpc_web_call_by_its_status() {
    // The failed call's effect stands (the separate mode's effects are outside the record);
    // its key was released, so the retry ran and charged again.
    a_web_call_is_stored_or_released_by_its_status(separate, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_mode_commits_or_rolls_back_a_grpc_web_call_by_its_status() {
    // The failed call's effect was rolled back with its transaction.
    a_web_call_is_stored_or_released_by_its_status(transactional, 0).await;
}

/// The base64 form, by hand (tonic has no such client): the same call twice gets the same
/// bytes back, charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_web_text_call_is_replayed_and_charged_once() {
    let Some((addr, payments)) = setup(separate).await else {
        return;
    };
    let k = key("web-text");
    let message = prost::Message::encode_to_vec(&ChargeRequest { amount: 1200 });
    let mut frame = vec![0];
    frame.extend_from_slice(&(message.len() as u32).to_be_bytes());
    frame.extend_from_slice(&message);
    let body = base64::engine::general_purpose::STANDARD.encode(frame);
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<Bytes>>();
    let call = || async {
        let request = http::Request::post(format!("http://{addr}/test.Payments/Charge"))
            .header("content-type", "application/grpc-web-text")
            .header("accept", "application/grpc-web-text")
            .header("authorization", "Bearer alice")
            .header("idempotency-key", &k)
            .body(http_body_util::Full::new(Bytes::from(body.clone())))
            .unwrap();
        let response = http.request(request).await.unwrap();
        assert_eq!(response.status(), http::StatusCode::OK);
        response.into_body().collect().await.unwrap().to_bytes()
    };
    let first = call().await;
    let again = call().await;
    assert_eq!(again, first, "the retry replays the same bytes");
    // Decoded group by group (each chunk was encoded apart): it ends with status 0.
    let decoded: Vec<u8> = first
        .chunks(4)
        .flat_map(|quad| {
            base64::engine::general_purpose::STANDARD
                .decode(quad)
                .unwrap()
        })
        .collect();
    let trailers = String::from_utf8_lossy(&decoded);
    assert!(trailers.contains("grpc-status:0"), "{trailers}");
    assert_eq!(payments.attempts.load(Ordering::SeqCst), 1);
    assert_eq!(payments.effects(&k).await, 1);
}

/// A transactional server stream over the response limit: its messages stream before the
/// commit, its status only after it. Ending with `UNAVAILABLE`, then `INTERNAL`, it keeps no
/// writes and each retry runs again; ending with `OK`, it commits once, and a later retry is
/// not run again (`ALREADY_EXISTS`: too large to replay). On gRPC and on gRPC-web.
async fn a_large_stream_commits_only_with_a_stored_status(web: bool) {
    let Some((addr, payments)) = setup(transactional).await else {
        return;
    };
    let k = key("report");
    payments
        .endings
        .lock()
        .unwrap()
        .extend([Code::Unavailable, Code::Internal]);
    let call = || async {
        if web {
            report(addr, &k).await
        } else {
            grpc_report(addr, &k).await
        }
    };
    for failure in [Code::Unavailable, Code::Internal] {
        let (messages, code) = call().await;
        assert_eq!(code, failure);
        assert_eq!(
            messages, REPORT_MESSAGES,
            "the messages streamed before the status"
        );
        assert_eq!(
            payments.effects(&k).await,
            0,
            "a failed stream kept its writes"
        );
    }
    assert_eq!(call().await, (REPORT_MESSAGES, Code::Ok));
    assert_eq!(payments.effects(&k).await, 1);
    let (_, code) = call().await;
    assert_eq!(
        code,
        Code::AlreadyExists,
        "completed, too large to replay, not run again"
    );
    assert_eq!(payments.attempts.load(Ordering::SeqCst), 3);
    assert_eq!(payments.effects(&k).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_grpc_stream_that_fails_at_its_end_keeps_no_writes() {
    a_large_stream_commits_only_with_a_stored_status(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_grpc_web_stream_that_fails_at_its_end_keeps_no_writes() {
    a_large_stream_commits_only_with_a_stored_status(true).await;
}

/// A large transactional stream whose status is a stored one, but whose commit fails (the
/// handler left a task holding the transaction): the client must not get that status. On
/// gRPC the trailers say what happened (`INTERNAL`, nothing committed); on gRPC-web, whose
/// status is data, the call ends broken. No writes persist either way.
async fn a_large_stream_whose_commit_fails_does_not_end_with_its_status(web: bool) {
    let Some((addr, payments)) = setup(transactional).await else {
        return;
    };
    let k = key("held");
    payments.hold_transaction.store(true, Ordering::SeqCst);
    let (messages, code) = match web {
        true => report(addr, &k).await,
        false => grpc_report(addr, &k).await,
    };
    match web {
        // A broken HTTP/1.1 body: the connection is closed, with whatever it had buffered.
        true => assert_ne!(code, Code::Ok, "a broken call, {messages} messages"),
        false => assert_eq!((messages, code), (REPORT_MESSAGES, Code::Internal)),
    }
    assert_eq!(payments.effects(&k).await, 0, "nothing committed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_grpc_stream_whose_commit_fails_ends_with_the_failure() {
    a_large_stream_whose_commit_fails_does_not_end_with_its_status(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_grpc_web_stream_whose_commit_fails_ends_broken() {
    a_large_stream_whose_commit_fails_does_not_end_with_its_status(true).await;
}

/// The separate mode, the same large gRPC-web stream: its status is found past the storage
/// limit too. Failed, its key is released (each retry runs, and its effect stands); done, it
/// is recorded as too large to replay, and not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_mode_finds_the_status_of_a_large_grpc_web_stream() {
    let Some((addr, payments)) = setup(separate).await else {
        return;
    };
    let k = key("separate-report");
    payments
        .endings
        .lock()
        .unwrap()
        .extend([Code::Unavailable, Code::Internal]);
    assert_eq!(report(addr, &k).await, (REPORT_MESSAGES, Code::Unavailable));
    assert_eq!(report(addr, &k).await, (REPORT_MESSAGES, Code::Internal));
    assert_eq!(report(addr, &k).await, (REPORT_MESSAGES, Code::Ok));
    let (_, code) = report(addr, &k).await;
    assert_eq!(
        code,
        Code::AlreadyExists,
        "completed, too large to replay, not run again"
    );
    assert_eq!(payments.attempts.load(Ordering::SeqCst), 3);
    assert_eq!(payments.effects(&k).await, 3);
}
