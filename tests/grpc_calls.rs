//! The layer under a tonic server, called by a tonic client over a real socket: duplicates
//! run once (counted in PostgreSQL) and get the identical reply, trailers included;
//! rejections are gRPC statuses; a status not to store releases the key.

#[path = "common/backends.rs"]
mod backends;
#[path = "common/pg_effects.rs"]
mod pg_effects;

use std::{
    convert::Infallible,
    future::Future,
    net::SocketAddr,
    pin::Pin,
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
}

#[derive(Clone, PartialEq, prost::Message)]
struct ChargeReply {
    #[prost(string, tag = "1")]
    charge_id: String,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

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

impl tonic::server::NamedService for Payments {
    const NAME: &'static str = "test.Payments";
}

impl<B> tower::Service<http::Request<B>> for Payments
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let charge = Charge(self.clone());
        Box::pin(async move {
            let mut grpc =
                tonic::server::Grpc::new(ProstCodec::<ChargeReply, ChargeRequest>::default());
            Ok(grpc.unary(charge, request).await)
        })
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
            let key = request
                .metadata()
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned();
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
        .add_service(payments)
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
    mut client: tonic::client::Grpc<Channel>,
    key: Option<&str>,
    amount: i64,
) -> Result<(ChargeReply, Vec<(String, String)>), Status> {
    let mut request = Request::new(ChargeRequest { amount });
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
    let mut metadata: Vec<(String, String)> = reply
        .metadata()
        .clone()
        .into_headers()
        .iter()
        .filter(|(name, _)| name.as_str() != "date")
        .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
        .collect();
    metadata.sort();
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
    let effects = pg_effects::effects(
        &payments.store,
        &payments.table,
        &StoreKey::new("unused".to_owned(), key.clone()),
    )
    .await;
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
    let effects = pg_effects::effects(
        &payments.store,
        &payments.table,
        &StoreKey::new("unused".to_owned(), key.clone()),
    )
    .await;
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
    let owner = {
        let client = client(addr).await;
        let key = key.clone();
        tokio::spawn(async move { charge(client, Some(&key)).await })
    };
    // Wait until the owner is inside its handler.
    while payments.attempts.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
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
