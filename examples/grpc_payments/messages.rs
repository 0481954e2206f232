//! The messages of `payments.proto`, written out as prost's generated code would be, so
//! the example needs no `protoc` and no build script:
//!
//! ```proto
//! syntax = "proto3";
//! package payments;
//!
//! service Payments {
//!   rpc Charge(ChargeRequest) returns (Receipt);
//!   rpc Stats(StatsRequest) returns (StatsReply);
//! }
//! message ChargeRequest { int64 amount_cents = 1; string currency = 2; string request_id = 3; }
//! message Receipt { string charge_id = 1; int64 amount_cents = 2; string currency = 3; }
//! message StatsRequest {}
//! message StatsReply { uint64 charges = 1; }
//! ```
#![allow(dead_code)] // the load generator uses a part

/// `Charge`'s request. `request_id` (AIP-155) is the key when no `idempotency-key`
/// metadata is sent.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ChargeRequest {
    #[prost(int64, tag = "1")]
    pub amount_cents: i64,
    #[prost(string, tag = "2")]
    pub currency: String,
    #[prost(string, tag = "3")]
    pub request_id: String,
}

/// What a charge answers: the same receipt to every retry of one key.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Receipt {
    #[prost(string, tag = "1")]
    pub charge_id: String,
    #[prost(int64, tag = "2")]
    pub amount_cents: i64,
    #[prost(string, tag = "3")]
    pub currency: String,
}

/// `Stats`'s request: nothing.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StatsRequest {}

/// The charges recorded in this database (or process).
#[derive(Clone, PartialEq, prost::Message)]
pub struct StatsReply {
    #[prost(uint64, tag = "1")]
    pub charges: u64,
}

/// The full method paths, as a gRPC client sends them.
pub const CHARGE: &str = "/payments.Payments/Charge";
pub const STATS: &str = "/payments.Payments/Stats";

/// The key a `ChargeRequest` carries in `request_id`, for the layer's
/// `key_from_message`; an empty `request_id` (proto3's unset) is no key.
pub fn request_id(message: &[u8]) -> Option<String> {
    let id = <ChargeRequest as prost::Message>::decode(message)
        .ok()?
        .request_id;
    (!id.is_empty()).then_some(id)
}
