//! The effects, read in the database itself: every charge row with its payment and amount
//! (each key of a run charges an amount of its own, so the rows of a key are found by
//! amount, and a double is a second row for one amount).

use sqlx::SqlitePool;

use crate::process::shared::Shared;

/// One row of `charges`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChargeRow {
    pub payment_id: String,
    pub amount: i64,
}

/// Every charge row of `shared`'s database.
pub async fn charges(shared: &Shared) -> Vec<ChargeRow> {
    let rows: Result<Vec<(String, i64)>, sqlx::Error> = match shared {
        Shared::Postgres { admin, schema, .. } => {
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT payment_id, amount FROM {schema}.charges"
            )))
            .fetch_all(admin)
            .await
        }
        Shared::MySql {
            admin, database, ..
        } => {
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT payment_id, amount FROM {database}.charges"
            )))
            .fetch_all(admin)
            .await
        }
        Shared::Sqlite { url, .. } => {
            let pool = SqlitePool::connect(url).await.expect("open the SQLite file");
            let rows = sqlx::query_as("SELECT payment_id, amount FROM charges")
                .fetch_all(&pool)
                .await;
            pool.close().await;
            rows
        }
    };
    rows.expect("read the charge rows")
        .into_iter()
        .map(|(payment_id, amount)| ChargeRow { payment_id, amount })
        .collect()
}

/// Writes one more payment and charge of `amount` behind the example's back: the planted
/// double the checker's own test must catch.
pub async fn plant_charge(shared: &Shared, amount: i64) {
    let id = format!("planted{:016x}", rand::random::<u64>());
    // `{t}`: where the tables are (the private schema or database; SQLite: the file).
    let sql = |t: &str| {
        sqlx::AssertSqlSafe(format!(
            "INSERT INTO {t}payments (id, amount, currency, status, version) \
             VALUES ('{id}', {amount}, 'EUR', 'pending', 1); \
             INSERT INTO {t}charges (id, payment_id, amount, currency) \
             VALUES ('{id}', '{id}', {amount}, 'EUR')"
        ))
    };
    let done = match shared {
        Shared::Postgres { admin, schema, .. } => sqlx::raw_sql(sql(&format!("{schema}.")))
            .execute(admin)
            .await
            .map(drop),
        Shared::MySql {
            admin, database, ..
        } => sqlx::raw_sql(sql(&format!("{database}.")))
            .execute(admin)
            .await
            .map(drop),
        Shared::Sqlite { url, .. } => {
            let pool = SqlitePool::connect(url).await.expect("open the SQLite file");
            let result = sqlx::raw_sql(sql("")).execute(&pool).await.map(drop);
            pool.close().await;
            result
        }
    };
    done.expect("plant a charge");
}
