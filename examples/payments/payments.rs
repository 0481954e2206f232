//! Where payments and charges live.

use async_trait::async_trait;
use serde::Serialize;
use tower_idempotency::version::{Expected, MemoryVersioned, VersionedUpdate};

/// A payment as the API shows it (and as a row of the `payments` table).
#[derive(Debug, Clone, Serialize, PartialEq, Eq, sqlx::FromRow)]
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
    /// idempotency key — preventing doubles is the layer's job. In the transactional mode
    /// the writes go into the transaction the layer lent to this request (found in
    /// `extensions`), which commits them together with the stored response; otherwise they
    /// commit on their own.
    async fn create(
        &self,
        amount: i64,
        currency: &str,
        extensions: &http::Extensions,
    ) -> Result<Payment, Error>;
    async fn get(&self, id: &str) -> Result<Option<Payment>, Error>;
    /// Sets the status if the payment is still at a version `expected` accepts: ONE
    /// compare-and-set (`update_if_version`), no read before it. A lost race comes back as
    /// `Conflict` with the current payment, so the 412 can carry its ETag.
    async fn set_status(
        &self,
        id: &str,
        expected: Expected,
        status: &str,
        extensions: &http::Extensions,
    ) -> Result<VersionedUpdate<Payment>, Error>;
    /// How many charges were recorded.
    async fn charges(&self) -> Result<u64, Error>;
}

impl Payment {
    /// A new payment: a fresh random id, status `pending`, version 1.
    pub fn pending(amount: i64, currency: &str) -> Self {
        Self {
            id: format!("pay_{:016x}", rand::random::<u64>()),
            amount,
            currency: currency.to_owned(),
            status: "pending".to_owned(),
            version: 1,
        }
    }
}

/// Payments in this process' memory; the map keeps each payment's version.
#[derive(Default)]
pub struct MemoryPayments {
    rows: MemoryVersioned<String, Payment>,
}

#[async_trait]
impl Payments for MemoryPayments {
    async fn create(
        &self,
        amount: i64,
        currency: &str,
        _extensions: &http::Extensions,
    ) -> Result<Payment, Error> {
        let payment = Payment::pending(amount, currency);
        // Ids are random, so this never meets an existing one; the map's own version starts
        // at 1 like the payment's.
        let _ = self.rows.insert_new(payment.id.clone(), payment.clone());
        Ok(payment)
    }

    async fn get(&self, id: &str) -> Result<Option<Payment>, Error> {
        Ok(self.rows.get(&id.to_owned()).map(|row| row.value))
    }

    async fn set_status(
        &self,
        id: &str,
        expected: Expected,
        status: &str,
        _extensions: &http::Extensions,
    ) -> Result<VersionedUpdate<Payment>, Error> {
        Ok(self
            .rows
            .update_if_version(&id.to_owned(), expected, |payment| {
                payment.status = status.to_owned();
                payment.version += 1;
            }))
    }

    async fn charges(&self) -> Result<u64, Error> {
        Ok(self.rows.len() as u64)
    }
}
