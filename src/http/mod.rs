//! The HTTP face: a tower layer over any `Service<http::Request<B>>`. Nothing below this
//! module knows about HTTP.

mod answer;
mod body;
#[cfg(feature = "sqlx")]
mod collect;
mod config;
mod detach;
mod fingerprint;
pub mod grpc;
mod key;
mod layer;
mod policy;
mod rejection;
mod replay;
mod request_body;
mod scope;
mod service;
mod tee;
#[cfg(feature = "sqlx")]
mod transactional;
#[cfg(feature = "sqlx")]
mod tx_mode;

pub use body::ResponseBody;
pub use config::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};
pub use grpc::{grpc_message, is_final_grpc_by_default};
pub use key::{InvalidKey, MAX_KEY_LEN};
pub use layer::IdempotencyLayer;
pub use policy::{is_final_by_default, DoNotStore};
pub use rejection::Rejection;
pub use service::{IdempotencyService, ResponseFuture};
