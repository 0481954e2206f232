//! Values written into SQL text for PostgreSQL's simple query protocol.
//!
//! Why text at all: the owner's claim travels with its `BEGIN`, and its record with its
//! `COMMIT`, each in one round trip, and only the simple protocol carries several statements
//! in one message; it has no parameters. (Bound statements would add a round trip to each:
//! measured in BENCHMARKS.md, "PostgreSQL's own share of the transactional mode".)
//!
//! Why this is safe: a value is written as hexadecimal digits inside `decode('…', 'hex')`.
//! No digit can end the quoted string or start an escape, whatever
//! `standard_conforming_strings` or the client encoding say, so there is no escaping to get
//! wrong. Text is `convert_from(…, 'UTF8')` of its UTF-8 bytes: the server checks them as it
//! checks a bound parameter, and refuses a NUL (which no PostgreSQL text can hold) in the same
//! way, with SQLSTATE 22021. The property test below compares both forms on a real server.

use std::fmt::Write;

/// A value to write into SQL text.
#[derive(Debug, Clone, Copy)]
pub(super) enum Value<'a> {
    /// A `text` value.
    Text(&'a str),
    /// A `bytea` value.
    Bytes(&'a [u8]),
}

/// Appends `value` to `sql` as an expression of its type.
pub(super) fn push(sql: &mut String, value: Value<'_>) {
    let bytes = match value {
        Value::Text(text) => {
            sql.push_str("convert_from(");
            text.as_bytes()
        }
        Value::Bytes(bytes) => bytes,
    };
    sql.reserve(2 * bytes.len() + 40);
    sql.push_str("decode('");
    for byte in bytes {
        // Writing into a String cannot fail.
        let _ = write!(sql, "{byte:02x}");
    }
    sql.push_str("', 'hex')");
    if let Value::Text(_) = value {
        sql.push_str(", 'UTF8')");
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use proptest::strategy::Just;
    use sqlx::{Connection, PgConnection, Row};

    use super::*;

    fn text(value: &str) -> String {
        let mut sql = String::new();
        push(&mut sql, Value::Text(value));
        sql
    }

    #[test]
    fn only_hex_digits_are_quoted() {
        let sql = text("it's a \\ key");
        let quoted = sql.split('\'').nth(1).expect("a quoted part");
        assert!(quoted.bytes().all(|b| b.is_ascii_hexdigit()), "{sql}");
        let mut bytes = String::new();
        push(&mut bytes, Value::Bytes(&[0, 0xff]));
        assert_eq!(bytes, "decode('00ff', 'hex')");
    }

    async fn connect() -> PgConnection {
        let url = std::env::var("TEST_POSTGRES_URL").expect(
            "TEST_POSTGRES_URL must point at a PostgreSQL server (scripts/services.sh sets it)",
        );
        PgConnection::connect(&url)
            .await
            .expect("connect to TEST_POSTGRES_URL")
    }

    /// What the server makes of `value` sent bound, and written by [`push`]: the same value,
    /// or the same SQLSTATE.
    async fn both_forms(
        conn: &mut PgConnection,
        value: &str,
    ) -> (Result<String, String>, Result<String, String>) {
        let state = |error: sqlx::Error| match error {
            sqlx::Error::Database(db) => db.code().unwrap_or_default().into_owned(),
            other => panic!("not a database error: {other}"),
        };
        let bound = sqlx::query("SELECT $1::text AS v")
            .bind(value)
            .fetch_one(&mut *conn)
            .await
            .map(|row| row.get::<String, _>("v"))
            .map_err(state);
        let written = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SELECT {} AS v", text(value))))
            .fetch_one(&mut *conn)
            .await
            .map(|row| row.get::<String, _>("v"))
            .map_err(state);
        (bound, written)
    }

    #[tokio::test]
    async fn hostile_keys_reach_the_server_as_bound_ones_do() {
        let mut conn = connect().await;
        for value in [
            "",
            "'",
            "''; DROP TABLE x; --",
            "\\",
            "\\x00",
            "E'\\''",
            "$$",
            "\u{0}",
            "a\u{0}b",
            "\u{10FFFF}\u{FEFF}\u{202E}",
            "日本語のキー",
        ] {
            let (bound, written) = both_forms(&mut conn, value).await;
            assert_eq!(bound, written, "{value:?}");
            if value.contains('\0') {
                assert_eq!(written, Err("22021".to_owned()), "a NUL is refused");
            } else {
                assert_eq!(written.as_deref(), Ok(value));
            }
        }
    }

    #[test]
    fn every_key_reaches_the_server_as_the_bound_form_sends_it() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let conn = std::cell::RefCell::new(runtime.block_on(connect()));
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
            cases: 2000,
            ..ProptestConfig::default()
        });
        // Any Unicode, and strings made mostly of the characters quoting is about.
        let keys = prop_oneof![
            any::<String>(),
            proptest::collection::vec(
                prop_oneof![
                    Just('\''),
                    Just('\\'),
                    Just('\0'),
                    Just('$'),
                    Just('E'),
                    Just('x'),
                    any::<char>()
                ],
                0..40
            )
            .prop_map(|chars| chars.into_iter().collect::<String>()),
        ];
        runner
            .run(&keys, |value| {
                let (bound, written) = runtime.block_on(both_forms(&mut conn.borrow_mut(), &value));
                prop_assert_eq!(bound, written);
                Ok(())
            })
            .expect("every key reaches the server as the bound form sends it");
    }
}
