//! placeholder: crate docs come with the layer
#![cfg_attr(docsrs, feature(doc_auto_cfg))]
#![warn(missing_docs)]

pub mod problem;
pub mod record;
pub mod store;
pub mod version;

pub use record::{ClaimOutcome, Fingerprint, Record, StoreKey, Token};

/// The boxed error type used for sources and inner-service errors.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;
