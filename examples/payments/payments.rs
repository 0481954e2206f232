//! Where payments and charges live.

use std::{
    collections::HashMap,
    sync::{Mutex, PoisonError},
};

use async_trait::async_trait;
use serde::Serialize;

/// A payment as the API shows it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Payment {
    pub id: String,
    pub amount: i64,
    pub currency: String,
    pub status: String,
    pub version: i64,
}

pub type Error = Box<dyn std::error::Error + Send + Sync>;

#[async_trait]
pub trait Payments: Send + Sync {
    /// Records one charge and the payment it created: a plain INSERT, no uniqueness on any
    /// idempotency key — preventing doubles is the layer's job.
    async fn create(&self, amount: i64, currency: &str) -> Result<Payment, Error>;
    async fn get(&self, id: &str) -> Result<Option<Payment>, Error>;
    /// How many charges were recorded.
    async fn charges(&self) -> Result<u64, Error>;
}

pub fn new_id() -> String {
    format!("pay_{:016x}", rand::random::<u64>())
}

/// Payments in this process' memory.
#[derive(Default)]
pub struct MemoryPayments {
    rows: Mutex<HashMap<String, Payment>>,
}

#[async_trait]
impl Payments for MemoryPayments {
    async fn create(&self, amount: i64, currency: &str) -> Result<Payment, Error> {
        let payment = Payment {
            id: new_id(),
            amount,
            currency: currency.to_owned(),
            status: "pending".to_owned(),
            version: 1,
        };
        self.rows
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(payment.id.clone(), payment.clone());
        Ok(payment)
    }

    async fn get(&self, id: &str) -> Result<Option<Payment>, Error> {
        Ok(self
            .rows
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .cloned())
    }

    async fn charges(&self) -> Result<u64, Error> {
        Ok(self
            .rows
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len() as u64)
    }
}
