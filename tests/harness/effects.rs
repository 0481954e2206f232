//! The effects, read in the database itself: every charge row with its payment and amount
//! (each key of a run charges an amount of its own, so the rows of a key are found by
//! amount, and a double is a second row for one amount).
//!
//! Also used on its own by tests/fault_partition.rs, which needs only this part.
#![allow(dead_code)]

use sqlx::SqlitePool;

use crate::process::{shared::Shared, unique, Charge};

/// A fresh key of `caller` charging `amount`: the amount is what finds its rows, so it must
/// be unique within a run.
pub fn charge_of(amount: i64, caller: &str) -> Charge {
    Charge::new(&unique(), caller).body(&format!(r#"{{"amount": {amount}, "currency": "EUR"}}"#))
}

/// One row of `charges`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChargeRow {
    pub payment_id: String,
    pub amount: i64,
}

/// Runs `$body` with `$pool` bound to an admin pool on `$shared`'s database and `$t` to the
/// prefix that qualifies its tables (the private schema or database; nothing for SQLite,
/// whose file is opened for the occasion).
macro_rules! on_tables {
    ($shared:expr, |$pool:ident, $t:ident| $body:expr) => {
        match $shared {
            Shared::Postgres { admin, schema, .. } => {
                let ($pool, $t) = (admin, format!("{schema}."));
                $body
            }
            Shared::MySql {
                admin, database, ..
            } => {
                let ($pool, $t) = (admin, format!("{database}."));
                $body
            }
            Shared::Sqlite { url, .. } => {
                let pool = SqlitePool::connect(url)
                    .await
                    .expect("open the SQLite file");
                let ($pool, $t) = (&pool, String::new());
                let result = $body;
                pool.close().await;
                result
            }
        }
    };
}

/// Every charge row of `shared`'s database.
pub async fn charges(shared: &Shared) -> Vec<ChargeRow> {
    let rows: Vec<(String, i64)> = on_tables!(shared, |pool, t| {
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT payment_id, amount FROM {t}charges"
        )))
        .fetch_all(pool)
        .await
    })
    .expect("read the charge rows");
    rows.into_iter()
        .map(|(payment_id, amount)| ChargeRow { payment_id, amount })
        .collect()
}

/// Writes one more payment and charge of `amount` behind the example's back: the planted
/// double the checker's own test must catch.
pub async fn plant_charge(shared: &Shared, amount: i64) {
    let id = format!("planted{:016x}", rand::random::<u64>());
    on_tables!(shared, |pool, t| {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {t}payments (id, amount, currency, status, version) \
             VALUES ('{id}', {amount}, 'EUR', 'pending', 1); \
             INSERT INTO {t}charges (id, payment_id, amount, currency) \
             VALUES ('{id}', '{id}', {amount}, 'EUR')"
        )))
        .execute(pool)
        .await
        .map(drop)
    })
    .expect("plant a charge");
}
