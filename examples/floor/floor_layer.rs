//! The floor: the least any idempotency layer must do for a request with a key, as a bench
//! subject (not part of the library). It reads the whole request body and hashes it
//! (SHA-256, as the library's fingerprint does), inserts the key into a concurrent map
//! (sharded mutexes), runs the handler, buffers its response and keeps a copy for replay.
//! A key seen before is replayed from that copy (or refused while it runs, or when the body
//! differs).
//!
//! What it leaves out is the library's guarantees: scoping keys by caller, leases and their
//! renewal, waiting duplicates, detaching work whose caller left, streaming the response
//! while it is copied, storage limits, metrics, spans. The table in BENCHMARKS.md prices
//! each of them.

use std::{
    collections::HashMap,
    hash::{BuildHasher, RandomState},
    sync::{Arc, Mutex},
    task::{Context, Poll},
};

use axum::{
    body::{Body, Bytes},
    extract::Request,
    http::{HeaderMap, StatusCode},
    response::Response,
};
use futures_util::future::BoxFuture;
use http_body_util::BodyExt;
use sha2::{Digest, Sha256};
use tower::{Layer, Service};

const SHARDS: usize = 16;

/// A key's entry: running, or its response kept for replay.
enum Slot {
    Running,
    Done(Arc<Kept>),
}

/// A response kept for replay.
struct Kept {
    fingerprint: [u8; 32],
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

#[derive(Default)]
struct Map {
    hasher: RandomState,
    shards: [Mutex<HashMap<String, Slot>>; SHARDS],
}

impl Map {
    fn shard(&self, key: &str) -> &Mutex<HashMap<String, Slot>> {
        &self.shards[self.hasher.hash_one(key) as usize % SHARDS]
    }
}

/// The floor's layer: one map shared by every clone.
#[derive(Clone, Default)]
pub struct FloorLayer {
    map: Arc<Map>,
}

impl<S> Layer<S> for FloorLayer {
    type Service = Floor<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Floor {
            inner,
            map: self.map.clone(),
        }
    }
}

/// The floor's service.
#[derive(Clone)]
pub struct Floor<S> {
    inner: S,
    map: Arc<Map>,
}

fn answer(status: StatusCode) -> Response {
    let mut response = Response::new(Body::empty());
    *response.status_mut() = status;
    response
}

impl<S> Service<Request> for Floor<S>
where
    S: Service<Request, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let Some(key) = request
            .headers()
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
        else {
            return Box::pin(self.inner.call(request));
        };
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let map = self.map.clone();
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
                return Ok(answer(StatusCode::BAD_REQUEST));
            };
            let fingerprint: [u8; 32] = Sha256::digest(&body).into();
            let shard = map.shard(&key);
            {
                let mut slots = shard.lock().unwrap();
                match slots.get(&key) {
                    None => {
                        slots.insert(key.clone(), Slot::Running);
                    }
                    Some(Slot::Done(kept)) if kept.fingerprint == fingerprint => {
                        let mut response = Response::new(Body::from(kept.body.clone()));
                        *response.status_mut() = kept.status;
                        *response.headers_mut() = kept.headers.clone();
                        return Ok(response);
                    }
                    Some(Slot::Running) => return Ok(answer(StatusCode::CONFLICT)),
                    Some(Slot::Done(_)) => return Ok(answer(StatusCode::UNPROCESSABLE_ENTITY)),
                }
            }
            let response = inner
                .call(Request::from_parts(parts, Body::from(body)))
                .await?;
            let (parts, body) = response.into_parts();
            let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
                shard.lock().unwrap().remove(&key);
                return Ok(answer(StatusCode::BAD_GATEWAY));
            };
            let kept = Kept {
                fingerprint,
                status: parts.status,
                headers: parts.headers.clone(),
                body: body.clone(),
            };
            shard
                .lock()
                .unwrap()
                .insert(key, Slot::Done(Arc::new(kept)));
            Ok(Response::from_parts(parts, Body::from(body)))
        })
    }
}
