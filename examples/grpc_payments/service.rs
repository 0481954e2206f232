//! The `payments.Payments` service, written out as tonic's generated server code would be:
//! a tower service that routes by method path and lets `tonic::server::Grpc` decode the
//! request and encode the answer.

use std::{
    convert::Infallible,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use tonic::{server::UnaryService, Request, Response, Status};
use tonic_prost::ProstCodec;
use tower::{Layer, ServiceExt};
use tower_idempotency::{IdempotencyLayer, IdempotencyService};

use crate::{
    ledger::Ledger,
    messages::{ChargeRequest, Receipt, StatsReply, StatsRequest, CHARGE, STATS},
};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The service: `Charge` behind the idempotency layer, `Stats` without it (a read needs no
/// key, and the layer would ask every call for one: keys are required on `Charge`).
#[derive(Clone)]
pub struct Payments {
    charge: IdempotencyService<ChargeRoute>,
    ledger: Arc<Ledger>,
}

impl Payments {
    pub fn new(ledger: Arc<Ledger>, handler_delay: Duration, layer: &IdempotencyLayer) -> Self {
        let route = ChargeRoute {
            ledger: ledger.clone(),
            handler_delay,
        };
        Self {
            charge: layer.layer(route),
            ledger,
        }
    }
}

impl tonic::server::NamedService for Payments {
    const NAME: &'static str = "payments.Payments";
}

impl<B> tower::Service<http::Request<B>> for Payments
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let payments = self.clone();
        Box::pin(async move {
            Ok(match request.uri().path() {
                CHARGE => {
                    // The layer hands the body it read on as a body built from bytes, which
                    // tonic's is not: axum's is.
                    let request = request.map(axum::body::Body::new);
                    let response = payments.charge.oneshot(request).await?;
                    response.map(tonic::body::Body::new)
                }
                STATS => {
                    let codec = ProstCodec::<StatsReply, StatsRequest>::default();
                    tonic::server::Grpc::new(codec)
                        .unary(Stats(payments.ledger), request)
                        .await
                }
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

/// The `Charge` method as a tower service, for the layer to wrap.
#[derive(Clone)]
struct ChargeRoute {
    ledger: Arc<Ledger>,
    /// `PAYMENTS_HANDLER_DELAY_MS`: a charge waits this long first (widens race windows).
    handler_delay: Duration,
}

impl tower::Service<http::Request<axum::body::Body>> for ChargeRoute {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<axum::body::Body>) -> Self::Future {
        let charge = Charge(self.clone());
        Box::pin(async move {
            let codec = ProstCodec::<Receipt, ChargeRequest>::default();
            Ok(tonic::server::Grpc::new(codec).unary(charge, request).await)
        })
    }
}

/// `Charge`: validate, then record exactly one charge.
struct Charge(ChargeRoute);

impl UnaryService<ChargeRequest> for Charge {
    type Response = Receipt;
    type Future = BoxFuture<Result<Response<Receipt>, Status>>;

    fn call(&mut self, request: Request<ChargeRequest>) -> Self::Future {
        let payments = self.0.clone();
        Box::pin(async move {
            let (_, extensions, charge) = request.into_parts();
            validate(&charge)?;
            if !payments.handler_delay.is_zero() {
                tokio::time::sleep(payments.handler_delay).await;
            }
            let receipt = payments
                .ledger
                .charge(charge.amount_cents, &charge.currency, &extensions)
                .await
                // INTERNAL is not stored: the key is released and a retry charges anew (in
                // the transactional mode nothing of this call was committed).
                .map_err(|error| Status::internal(format!("the charge failed: {error}")))?;
            Ok(Response::new(receipt))
        })
    }
}

/// An invalid message charges nothing; the layer is told not to store its
/// `INVALID_ARGUMENT` (see `main.rs`), so the fixed call may reuse its key.
fn validate(charge: &ChargeRequest) -> Result<(), Status> {
    if !(1..=1_000_000).contains(&charge.amount_cents) {
        return Err(Status::invalid_argument(format!(
            "amount_cents must be from 1 to 1000000, got {}",
            charge.amount_cents
        )));
    }
    if charge.currency.len() != 3 || !charge.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(Status::invalid_argument(format!(
            "currency must be 3 uppercase letters, got {:?}",
            charge.currency
        )));
    }
    Ok(())
}

/// `Stats`: the charges recorded in this database (or process).
struct Stats(Arc<Ledger>);

impl UnaryService<StatsRequest> for Stats {
    type Response = StatsReply;
    type Future = BoxFuture<Result<Response<StatsReply>, Status>>;

    fn call(&mut self, _: Request<StatsRequest>) -> Self::Future {
        let ledger = self.0.clone();
        Box::pin(async move {
            let charges = ledger
                .charges()
                .await
                .map_err(|error| Status::internal(error.to_string()))?;
            Ok(Response::new(StatsReply { charges }))
        })
    }
}
