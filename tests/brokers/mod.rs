//! What the Kafka and SQS tests share: clients for the local servers `scripts/services.sh`
//! starts (tansu, moto), and consumer processes the tests SIGKILL.
#![allow(dead_code)]

pub mod child;
pub mod kafka;
pub mod sqs;
