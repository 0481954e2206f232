#![doc = include_str!("../README.md")]
//!
//! # Crate layout
//!
//! Data flows one way: the HTTP face ([`http`]) asks the [`engine`], which asks a
//! [`store::Store`]. Nothing below [`http`] knows about HTTP; [`record`] holds what is stored.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

pub mod broker;
mod clock;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod engine;
pub mod http;
#[cfg(feature = "sqlx")]
pub mod inbox;
pub mod metrics;
#[cfg(feature = "sqlx")]
pub mod outbox;
pub mod problem;
pub mod record;
#[cfg(feature = "sqlx")]
pub mod sql;
pub mod steps;
pub mod store;
mod sync;
#[cfg(feature = "sqlx")]
pub mod transactional;
pub mod version;

pub use crate::http::{
    grpc_message, is_final_by_default, is_final_grpc_by_default, DoNotStore, IdempotencyLayer,
    IdempotencyService, Principal, Rejection,
};
pub use engine::{Engine, InProgressPolicy};
pub use record::{ClaimOutcome, Fingerprint, Record, StoreKey, Token};

/// The boxed error type used for sources and inner-service errors.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;
