//! The layer under a tonic server, called by a tonic client over a real socket: duplicates
//! run once (counted in PostgreSQL) and get the identical reply, trailers included;
//! rejections are gRPC statuses; a status not to store releases the key.

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

use grpc_metadata::comparable_metadata;
use grpc_service::{BoxFuture, Handwritten};
use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
};

use bytes::Bytes;
use http::uri::PathAndQuery;
use tonic::{transport::Channel, Code, Request, Response, Status};
use tonic_prost::ProstCodec;
use tower::ServiceBuilder;
use tower_idempotency::{
    store::PostgresStore, Engine, IdempotencyLayer, InProgressPolicy, StoreKey,
};

#[derive(Clone, PartialEq, prost::Message)]
struct ChargeRequest {
    #[prost(int64, tag = "1")]
    amount: i64,
    /// Google AIP-155's request id: the key, for a layer that reads it from the message.
    #[prost(string, tag = "2")]
    request_id: String,
}

/// The part of [`ChargeRequest`] the layer's message key extractor decodes.
#[derive(Clone, PartialEq, prost::Message)]
struct RequestId {
    #[prost(string, tag = "2")]
    request_id: String,
}

/// The extractor the message-keyed tests register: an empty `request_id` is no key.
fn request_id(message: &[u8]) -> Option<String> {
    let id = <RequestId as prost::Message>::decode(message)
        .ok()?
        .request_id;
    (!id.is_empty()).then_some(id)
}

#[derive(Clone, PartialEq, prost::Message)]
struct ChargeReply {
    #[prost(string, tag = "1")]
    charge_id: String,
}

/// A one-method gRPC service, written out as tonic's generated code would be.
#[derive(Clone)]
struct Payments {
    store: PostgresStore,
    table: Arc<str>,
    attempts: Arc<AtomicUsize>,
    /// The next call fails with UNAVAILABLE before it does anything.
    fail_next: Arc<AtomicBool>,
    /// How long a call holds before it charges, in milliseconds.
    hold_ms: Arc<AtomicU64>,
}

impl Payments {
    /// The charge rows the handler wrote under `key`, counted in the database.
    async fn charges_for(&self, key: &str) -> i64 {
        let key = StoreKey::new("unused".to_owned(), key.to_owned());
        pg_effects::effects(&self.store, &self.table, &key).await
    }
}

impl Payments {
    /// The service tonic serves: its one method.
    fn service(&self) -> Handwritten {
        let payments = self.clone();
        Handwritten(Arc::new(move |request| {
            let charge = Charge(payments.clone());
            Box::pin(async move {
                let codec = ProstCodec::<ChargeReply, ChargeRequest>::default();
                tonic::server::Grpc::new(codec).unary(charge, request).await
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
            payments.attempts.fetch_add(1, Ordering::SeqCst);
            if payments.fail_next.swap(false, Ordering::SeqCst) {
                return Err(Status::unavailable("the bank is down"));
            }
            // The effect is filed under the key the call was made with, wherever it came.
            let key = request
                .metadata()
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
                .unwrap_or_else(|| request.get_ref().request_id.clone());
            // Held a moment so that concurrent duplicates really overlap the owner.
            let hold = payments.hold_ms.load(Ordering::SeqCst);
            tokio::time::sleep(std::time::Duration::from_millis(hold)).await;
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {} (k) VALUES ($1)",
                payments.table
            )))
            .bind(&key)
            .execute(payments.store.pool())
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
            let mut reply = Response::new(ChargeReply {
                charge_id: format!("ch_{}", tower_idempotency::Token::random().to_hex()),
            });
            reply
                .metadata_mut()
                .insert("x-charged-amount", request.get_ref().amount.into());
            Ok(reply)
        })
    }
}

/// Serves `payments` behind `layer` on a free port. tonic's request body is not
/// `From<Bytes>`, which the layer needs to hand the read body on: it is mapped to axum's.
async fn serve(layer: IdempotencyLayer, payments: Payments) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stack = ServiceBuilder::new()
        .map_request(|r: http::Request<tonic::body::Body>| r.map(axum::body::Body::new))
        .layer(layer);
    let server = tonic::transport::Server::builder()
        .layer(stack)
        .add_service(payments.service())
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(server);
    addr
}

async fn client(addr: SocketAddr) -> tonic::client::Grpc<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    tonic::client::Grpc::new(channel)
}

/// One call: the reply's message and metadata (headers and trailers, which tonic merges for
/// a unary call) minus `date`, or its status.
async fn charge(
    client: tonic::client::Grpc<Channel>,
    key: Option<&str>,
) -> Result<(ChargeReply, Vec<(String, String)>), Status> {
    charge_amount(client, key, 1200).await
}

async fn charge_amount(
    client: tonic::client::Grpc<Channel>,
    key: Option<&str>,
    amount: i64,
) -> Result<(ChargeReply, Vec<(String, String)>), Status> {
    let message = ChargeRequest {
        amount,
        request_id: String::new(),
    };
    call(client, key, message, None).await
}

/// A tonic client on a bare HTTP/2 connection. tonic's `Channel` enforces a call's
/// `grpc-timeout` itself (answering `CANCELLED` the moment it passes, before the server's
/// answer can arrive); this one leaves the deadline to the server, so a test sees what the
/// layer answered when it passed.
async fn client_leaving_deadlines_to_the_server(
    addr: SocketAddr,
) -> tonic::client::Grpc<
    impl tonic::client::GrpcService<
            tonic::body::Body,
            ResponseBody = hyper::body::Incoming,
            Error = hyper::Error,
        > + Clone,
> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let service = tower::service_fn(move |request: http::Request<tonic::body::Body>| {
        let mut sender = sender.clone();
        async move { sender.send_request(request).await }
    });
    tonic::client::Grpc::with_origin(service, format!("http://{addr}").parse().unwrap())
}

/// One call of `message`, with `key` as metadata and `timeout` as its `grpc-timeout`.
async fn call<T>(
    mut client: tonic::client::Grpc<T>,
    key: Option<&str>,
    message: ChargeRequest,
    timeout: Option<std::time::Duration>,
) -> Result<(ChargeReply, Vec<(String, String)>), Status>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::ResponseBody: http_body::Body<Data = Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    T::Error: std::fmt::Debug,
{
    let mut request = Request::new(message);
    if let Some(timeout) = timeout {
        request.set_timeout(timeout);
    }
    request
        .metadata_mut()
        .insert("authorization", "Bearer alice".parse().unwrap());
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
    }
    client.ready().await.unwrap();
    let reply = client
        .unary(
            request,
            PathAndQuery::from_static("/test.Payments/Charge"),
            ProstCodec::<ChargeRequest, ChargeReply>::default(),
        )
        .await?;
    let metadata = comparable_metadata(reply.metadata());
    Ok((reply.into_inner(), metadata))
}

async fn setup(
    layer: impl FnOnce(PostgresStore) -> IdempotencyLayer,
) -> Option<(SocketAddr, Payments)> {
    let (store, table) = pg_effects::store_and_table(16, "grpc_effects").await?;
    let payments = Payments {
        store: store.clone(),
        table: table.into(),
        attempts: Arc::new(AtomicUsize::new(0)),
        fail_next: Arc::new(AtomicBool::new(false)),
        hold_ms: Arc::new(AtomicU64::new(50)),
    };
    let addr = serve(layer(store), payments.clone()).await;
    Some((addr, payments))
}

/// Starts the call that owns `key` and returns once its handler runs, so that a call sent
/// next is surely a duplicate of a running call.
async fn start_owner(
    addr: SocketAddr,
    key: &str,
    payments: &Payments,
) -> tokio::task::JoinHandle<Result<(ChargeReply, Vec<(String, String)>), Status>> {
    let client = client(addr).await;
    let key = key.to_owned();
    let owner = tokio::spawn(async move { charge(client, Some(&key)).await });
    while payments.attempts.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    owner
}

fn key(name: &str) -> String {
    format!("{name}-{}", tower_idempotency::Token::random().to_hex())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_duplicates_charge_once_and_get_one_identical_reply() {
    let Some((addr, payments)) = setup(|store| IdempotencyLayer::new(store).require_key()).await
    else {
        return;
    };
    let key = key("storm");
    let mut calls = Vec::new();
    for _ in 0..64 {
        // A connection each, so the 64 calls really arrive together.
        let client = client(addr).await;
        let key = key.clone();
        calls.push(tokio::spawn(
            async move { charge(client, Some(&key)).await },
        ));
    }
    let mut replies = Vec::new();
    for call in calls {
        replies.push(call.await.unwrap().expect("every duplicate gets the reply"));
    }
    let effects = payments.charges_for(&key).await;
    assert_eq!(effects, 1, "one charge in the database");
    assert_eq!(payments.attempts.load(Ordering::SeqCst), 1);
    let first = &replies[0];
    assert!(
        first
            .1
            .contains(&("grpc-status".to_owned(), "0".to_owned())),
        "{:?}",
        first.1
    );
    assert!(first
        .1
        .contains(&("x-charged-amount".to_owned(), "1200".to_owned())));
    for reply in &replies {
        assert_eq!(reply, first, "message, headers and trailers identical");
    }
}

#[tokio::test]
async fn a_missing_key_is_invalid_argument() {
    let Some((addr, payments)) = setup(|store| IdempotencyLayer::new(store).require_key()).await
    else {
        return;
    };
    let status = charge(client(addr).await, None).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("Idempotency-Key"), "{status:?}");
    assert_eq!(payments.attempts.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn unavailable_is_not_stored_so_the_retry_runs_and_charges_once() {
    let Some((addr, payments)) = setup(IdempotencyLayer::new).await else {
        return;
    };
    let key = key("release");
    payments.fail_next.store(true, Ordering::SeqCst);
    let status = charge(client(addr).await, Some(&key)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    let (reply, _) = charge(client(addr).await, Some(&key))
        .await
        .expect("the retry runs");
    let (replayed, _) = charge(client(addr).await, Some(&key)).await.unwrap();
    assert_eq!(reply, replayed, "the success is stored and replayed");
    assert_eq!(payments.attempts.load(Ordering::SeqCst), 2);
    let effects = payments.charges_for(&key).await;
    assert_eq!(effects, 1);
}

#[tokio::test]
async fn the_same_key_with_another_message_is_invalid_argument_and_runs_nothing() {
    let Some((addr, payments)) = setup(IdempotencyLayer::new).await else {
        return;
    };
    let key = key("reuse");
    charge_amount(client(addr).await, Some(&key), 1200)
        .await
        .expect("the first call runs");
    let status = charge_amount(client(addr).await, Some(&key), 9900)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("different request"),
        "the message says why: {status:?}"
    );
    assert_eq!(payments.attempts.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_of_a_running_call_under_the_reject_policy_is_aborted_with_a_pushback() {
    let Some((addr, payments)) = setup(|store| {
        let engine = Engine::builder(store)
            .in_progress(InProgressPolicy::Reject)
            .retry_after(std::time::Duration::from_millis(1500))
            .build()
            .unwrap();
        IdempotencyLayer::from_engine(engine)
    })
    .await
    else {
        return;
    };
    let key = key("reject");
    // Long enough that the duplicate surely arrives while the owner runs, on a loaded machine.
    payments.hold_ms.store(2000, Ordering::SeqCst);
    let duplicate = client(addr).await;
    let owner = start_owner(addr, &key, &payments).await;
    let status = charge(duplicate, Some(&key)).await.unwrap_err();
    assert_eq!(status.code(), Code::Aborted, "{status:?}");
    assert_eq!(
        status
            .metadata()
            .get("grpc-retry-pushback-ms")
            .and_then(|v| v.to_str().ok()),
        Some("1500"),
        "{status:?}"
    );
    owner.await.unwrap().expect("the owner completes");
    assert_eq!(payments.attempts.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_whose_deadline_passes_while_it_waits_is_deadline_exceeded_and_runs_nothing() {
    let Some((addr, payments)) = setup(IdempotencyLayer::new).await else {
        return;
    };
    let key = key("deadline");
    // The owner runs far longer than the duplicate's deadline, even on a loaded machine.
    payments.hold_ms.store(3000, Ordering::SeqCst);
    let duplicate = client_leaving_deadlines_to_the_server(addr).await;
    let owner = start_owner(addr, &key, &payments).await;
    let message = ChargeRequest {
        amount: 1200,
        request_id: String::new(),
    };
    let timeout = Some(std::time::Duration::from_millis(300));
    let status = call(duplicate, Some(&key), message, timeout)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(
        status.message().contains("while it waited"),
        "the layer answered, not tonic's own timeout: {status:?}"
    );
    let owned = owner.await.unwrap().expect("the owner finishes");
    let retried = charge(client(addr).await, Some(&key))
        .await
        .expect("a later retry gets the owner's reply");
    assert_eq!(retried, owned, "the retry replays the owner's reply");
    assert_eq!(payments.attempts.load(Ordering::SeqCst), 1);
    let effects = payments.charges_for(&key).await;
    assert_eq!(effects, 1, "one charge in the database");
}

#[tokio::test]
async fn an_unreachable_store_is_unavailable_with_a_pushback_and_runs_nothing() {
    // The handler's database is real; only the idempotency store's pool points at a closed port.
    let Some((addr, payments)) = setup(|_| {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(std::time::Duration::from_millis(500))
            .connect_lazy("postgres://root@127.0.0.1:1/test")
            .expect("a valid URL");
        IdempotencyLayer::new(PostgresStore::new(pool))
    })
    .await
    else {
        return;
    };
    let key = key("unreachable");
    let status = charge(client(addr).await, Some(&key)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.metadata().get("grpc-retry-pushback-ms").is_some(),
        "{status:?}"
    );
    assert_eq!(payments.attempts.load(Ordering::SeqCst), 0, "nothing ran");
    let effects = payments.charges_for(&key).await;
    assert_eq!(effects, 0, "nothing charged");
}

/// A layer that reads the key from the message's `request_id` and requires one, so a call
/// that gets through was keyed by its message.
fn keyed_by_message(store: PostgresStore) -> IdempotencyLayer {
    IdempotencyLayer::new(store)
        .require_key()
        .key_from_message("/test.Payments/Charge", request_id)
}

fn with_request_id(request_id: &str) -> ChargeRequest {
    ChargeRequest {
        amount: 1200,
        request_id: request_id.to_owned(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_concurrent_calls_with_one_request_id_and_no_metadata_key_charge_once() {
    let Some((addr, payments)) = setup(keyed_by_message).await else {
        return;
    };
    let id = key("request-id");
    let start = Arc::new(tokio::sync::Barrier::new(2));
    let mut calls = Vec::new();
    for _ in 0..2 {
        let client = client(addr).await;
        let (id, start) = (id.clone(), start.clone());
        calls.push(tokio::spawn(async move {
            start.wait().await;
            call(client, None, with_request_id(&id), None).await
        }));
    }
    let mut replies = Vec::new();
    for call in calls {
        replies.push(call.await.unwrap().expect("both calls get the reply"));
    }
    assert_eq!(
        replies[0], replies[1],
        "message, headers and trailers identical"
    );
    assert_eq!(payments.attempts.load(Ordering::SeqCst), 1);
    let effects = payments.charges_for(&id).await;
    assert_eq!(effects, 1, "one charge in the database");
}

#[tokio::test]
async fn a_malformed_request_id_is_invalid_argument_and_runs_nothing() {
    let Some((addr, payments)) = setup(keyed_by_message).await else {
        return;
    };
    for (id, why) in [
        ("has a space", "visible ASCII"),
        (&"k".repeat(256)[..], "longer than 255"),
    ] {
        let status = call(client(addr).await, None, with_request_id(id), None)
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(why), "{status:?}");
    }
    // No request_id at all, and the key is required.
    let status = call(client(addr).await, None, with_request_id(""), None)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(payments.attempts.load(Ordering::SeqCst), 0, "nothing ran");
}

/// A method keyed by its message: the refusal of a call without a key says where the key
/// goes (the request message), not that a header is missing.
#[tokio::test]
async fn a_message_keyed_call_without_a_key_is_told_to_set_it_in_the_message() {
    let Some((addr, payments)) = setup(keyed_by_message).await else {
        return;
    };
    let status = call(client(addr).await, None, with_request_id(""), None)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("request message"), "{status:?}");
    assert!(!status.message().contains("header"), "{status:?}");
    assert_eq!(payments.attempts.load(Ordering::SeqCst), 0, "nothing ran");
}

#[tokio::test]
async fn the_metadata_key_wins_over_the_request_id() {
    let Some((addr, payments)) = setup(keyed_by_message).await else {
        return;
    };
    let (metadata_key, id) = (key("metadata"), key("request-id"));
    let first = call(
        client(addr).await,
        Some(&metadata_key),
        with_request_id(&id),
        None,
    )
    .await
    .expect("keyed by its metadata");
    // The same message without the metadata key is keyed by its request_id: another call.
    call(client(addr).await, None, with_request_id(&id), None)
        .await
        .expect("keyed by its request_id");
    assert_eq!(payments.attempts.load(Ordering::SeqCst), 2);
    let replayed = call(
        client(addr).await,
        Some(&metadata_key),
        with_request_id(&id),
        None,
    )
    .await
    .unwrap();
    assert_eq!(replayed, first, "the metadata-keyed call is replayed");
    assert_eq!(payments.attempts.load(Ordering::SeqCst), 2);
}
