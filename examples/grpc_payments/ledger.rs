//! Where charges are recorded: one row per charge in PostgreSQL, or a count in memory.
//!
//! The `grpc_charges` table has no unique constraint on an idempotency key: a duplicate call
//! that reached the handler WOULD charge twice. Preventing that is the layer's job alone.

use std::sync::atomic::{AtomicU64, Ordering};

use sqlx::{PgPool, Postgres};
use tower_idempotency::transactional::TxSlot;

use crate::messages::Receipt;

pub type Error = Box<dyn std::error::Error + Send + Sync>;

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS grpc_charges (
    id           VARCHAR(32) NOT NULL PRIMARY KEY,
    amount_cents BIGINT      NOT NULL,
    currency     CHAR(3)     NOT NULL,
    created_at   TIMESTAMP   NOT NULL DEFAULT CURRENT_TIMESTAMP
)";

pub enum Ledger {
    /// Charges counted in this process only.
    Memory(AtomicU64),
    Postgres(PgPool),
}

impl Ledger {
    /// The PostgreSQL ledger, its table created if missing. Processes starting together take
    /// turns behind an advisory lock: concurrent `CREATE TABLE IF NOT EXISTS` can collide on
    /// PostgreSQL's catalog.
    pub async fn postgres(pool: PgPool) -> Result<Self, Error> {
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('grpc_payments schema', 0))")
            .execute(&mut *tx)
            .await?;
        sqlx::query(SCHEMA).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(Self::Postgres(pool))
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::Memory(_) => "memory",
            Self::Postgres(_) => "postgres",
        }
    }

    /// Records one charge. In the transactional mode the INSERT runs in the layer's
    /// transaction (found in the request's extensions), so it commits together with the
    /// stored receipt, or not at all.
    pub async fn charge(
        &self,
        amount_cents: i64,
        currency: &str,
        extensions: &http::Extensions,
    ) -> Result<Receipt, Error> {
        let receipt = Receipt {
            charge_id: format!("ch_{:016x}", rand::random::<u64>()),
            amount_cents,
            currency: currency.to_owned(),
        };
        let pool = match self {
            Self::Memory(count) => {
                count.fetch_add(1, Ordering::SeqCst);
                return Ok(receipt);
            }
            Self::Postgres(pool) => pool,
        };
        let insert = sqlx::query(
            "INSERT INTO grpc_charges (id, amount_cents, currency) VALUES ($1, $2, $3)",
        )
        .bind(&receipt.charge_id)
        .bind(receipt.amount_cents)
        .bind(&receipt.currency);
        match extensions.get::<TxSlot<Postgres>>() {
            // Dropped before the handler answers: the layer commits only a transaction its
            // handler let go of.
            Some(slot) => insert.execute(&mut *slot.lock().await?).await?,
            None => insert.execute(pool).await?,
        };
        Ok(receipt)
    }

    /// The charges recorded so far.
    pub async fn charges(&self) -> Result<u64, Error> {
        match self {
            Self::Memory(count) => Ok(count.load(Ordering::SeqCst)),
            Self::Postgres(pool) => {
                let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM grpc_charges")
                    .fetch_one(pool)
                    .await?;
                Ok(u64::try_from(count)?)
            }
        }
    }
}
