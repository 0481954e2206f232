//! `VersionedTable` against real databases: PostgreSQL (`TEST_POSTGRES_URL`), MySQL /
//! MariaDB (`TEST_MYSQL_URL`) and SQLite (a temporary file). A backend whose URL is unset is
//! skipped, unless `TEST_REQUIRE_ALL_BACKENDS=1`. Every test creates its own table with a
//! random suffix and drops it at the end, so parallel runs do not collide.
#![cfg(all(feature = "postgres", feature = "mysql", feature = "sqlite"))]

use std::sync::Arc;

use tokio::sync::Barrier;
use tower_idempotency::version::{
    commit_if_updated, retry_on_conflict, ConflictReason, Expected, InsertOutcome, RetryPolicy,
    Version, VersionedTable, VersionedTableError, VersionedUpdate,
};

/// How many writers race for the same version.
const RACERS: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
struct Payment {
    id: i64,
    status: String,
    counter: i64,
    version: i64,
}

#[path = "common/backends.rs"]
mod backends;
use backends::url_or_skip as url;

fn table_name(test: &str) -> String {
    format!("vt_{test}_{:016x}", rand::random::<u64>())
}

/// The body shared by every backend. Each backend module defines `Db`, `Fixture` (with its
/// `pool` and `table`) and `setup` before expanding it.
macro_rules! suite {
    () => {
        async fn exec(f: &Fixture, sql: &str) {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(&f.pool)
                .await
                .unwrap();
        }

        async fn create_row(f: &Fixture, id: i64, status: &str) {
            let created = f
                .table
                .insert_new(&f.pool, id, |set| {
                    set.value("status", status.to_owned()).value("counter", 0i64);
                })
                .await
                .unwrap();
            assert_eq!(created, InsertOutcome::Created { version: Version::INITIAL });
        }

        async fn read(f: &Fixture, id: i64) -> Option<(Version, Payment)> {
            f.table.fetch::<Db, _, _, Payment>(&f.pool, id).await.unwrap()
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn racing_updaters_exactly_one_wins() {
            let Some(f) = setup("race").await else { return };
            create_row(&f, 1, "new").await;
            let (version, before) = read(&f, 1).await.unwrap();
            let barrier = Arc::new(Barrier::new(RACERS));
            let mut tasks = Vec::new();
            for racer in 0..RACERS {
                let (pool, table, barrier) = (f.pool.clone(), f.table.clone(), barrier.clone());
                let counter = before.counter;
                tasks.push(tokio::spawn(async move {
                    barrier.wait().await;
                    table
                        .update_if_version(&pool, 1i64, version, |set| {
                            set.value("counter", counter + 1)
                                .value("status", format!("racer {racer}"));
                        })
                        .await
                        .unwrap()
                }));
            }
            let (mut won, mut lost, mut aborted) = (0, 0, 0);
            for task in tasks {
                match task.await.unwrap() {
                    VersionedUpdate::Updated { version: new, .. } => {
                        assert_eq!(new, version.next());
                        won += 1;
                    }
                    VersionedUpdate::Conflict { current_version: Some(current), reason, .. } => {
                        assert_eq!(current, version.next(), "the loser must see the winner's version");
                        assert_eq!(reason, ConflictReason::VersionMismatch);
                        lost += 1;
                    }
                    VersionedUpdate::Conflict { current_version: None, reason, .. } => {
                        assert!(reason.is_abort());
                        aborted += 1;
                    }
                    VersionedUpdate::NotFound => panic!("the row exists"),
                }
            }
            eprintln!("{RACERS} racers: {won} won, {lost} lost on the version, {aborted} aborted by the database");
            assert_eq!((won, lost + aborted), (1, RACERS - 1));
            let (after_version, after) = read(&f, 1).await.unwrap();
            assert_eq!(after_version, version.next());
            assert_eq!(after.version, version.next().get());
            assert_eq!(after.counter, before.counter + 1, "the side effect happened once");
            f.drop_table().await;
        }

        #[tokio::test]
        async fn deleted_or_missing_row_is_not_found() {
            let Some(f) = setup("gone").await else { return };
            create_row(&f, 1, "new").await;
            exec(&f, &format!("DELETE FROM {} WHERE id = 1", f.name)).await;
            let outcome = f
                .table
                .update_if_version(&f.pool, 1i64, Version::INITIAL, |set| {
                    set.value("status", "paid");
                })
                .await
                .unwrap();
            assert_eq!(outcome, VersionedUpdate::NotFound);
            let outcome = f
                .table
                .update_if_version(&f.pool, 42i64, Expected::any(), |_| {})
                .await
                .unwrap();
            assert_eq!(outcome, VersionedUpdate::NotFound);
            assert_eq!(f.table.current_version::<Db, _, _>(&f.pool, 1i64).await.unwrap(), None);
            f.drop_table().await;
        }

        #[tokio::test]
        async fn stale_version_reports_the_current_version_and_row() {
            let Some(f) = setup("stale").await else { return };
            create_row(&f, 1, "new").await;
            let first = f
                .table
                .update_if_version_returning::<Db, _, _, Payment>(&f.pool, 1i64, Version::INITIAL, |set| {
                    set.value("status", "paid");
                })
                .await
                .unwrap();
            let VersionedUpdate::Updated { version, row: Some(row) } = first else {
                panic!("expected an update with its row, got {first:?}")
            };
            assert_eq!((version, row.status.as_str(), row.version), (Version::new(2), "paid", 2));
            let second = f
                .table
                .update_if_version_returning::<Db, _, _, Payment>(&f.pool, 1i64, Version::INITIAL, |set| {
                    set.value("status", "failed");
                })
                .await
                .unwrap();
            let VersionedUpdate::Conflict { current_version, row: Some(row), reason } = second else {
                panic!("expected a conflict with the current row, got {second:?}")
            };
            assert_eq!(current_version, Some(Version::new(2)));
            assert_eq!(reason, ConflictReason::VersionMismatch);
            assert_eq!(row.status, "paid");
            f.drop_table().await;
        }

        #[tokio::test]
        async fn no_op_update_is_an_update_not_a_conflict() {
            let Some(f) = setup("noop").await else { return };
            create_row(&f, 1, "new").await;
            // The same value it already has: on MySQL without CLIENT_FOUND_ROWS semantics a
            // naive statement would report 0 changed rows here.
            let outcome = f
                .table
                .update_if_version(&f.pool, 1i64, Version::INITIAL, |set| {
                    set.value("status", "new").value("counter", 0i64);
                })
                .await
                .unwrap();
            assert_eq!(outcome, VersionedUpdate::Updated { version: Version::new(2), row: None });
            // No values at all: a pure version bump ("touch").
            let outcome = f
                .table
                .update_if_version(&f.pool, 1i64, Version::new(2), |_| {})
                .await
                .unwrap();
            assert_eq!(outcome.version(), Some(Version::new(3)));
            f.drop_table().await;
        }

        #[tokio::test]
        async fn expectations_beyond_one_version() {
            let Some(f) = setup("expect").await else { return };
            create_row(&f, 1, "new").await;
            let update = |expected: Expected| {
                let (pool, table) = (f.pool.clone(), f.table.clone());
                async move { table.update_if_version(&pool, 1i64, expected, |_| {}).await.unwrap() }
            };
            let one_of = Expected::one_of([Version::new(9), Version::INITIAL]);
            assert_eq!(update(one_of).await.version(), Some(Version::new(2)));
            assert_eq!(update(Expected::any()).await.version(), Some(Version::new(3)));
            let nothing = update(Expected::nothing()).await;
            assert!(nothing.is_conflict());
            assert_eq!(nothing.version(), Some(Version::new(3)));
            assert!(update(Expected::one_of([])).await.is_conflict());
            assert!(update(Expected::any().excluding([Version::new(3)])).await.is_conflict());
            assert!(update(Expected::any().excluding([Version::new(2)])).await.is_updated());
            f.drop_table().await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn create_only_insert_reports_already_exists() {
            let Some(f) = setup("create").await else { return };
            create_row(&f, 1, "new").await;
            let again = f
                .table
                .insert_new(&f.pool, 1i64, |set| {
                    set.value("status", "dup").value("counter", 0i64);
                })
                .await
                .unwrap();
            assert!(matches!(again, InsertOutcome::AlreadyExists { .. }), "{again:?}");
            // Racing creators of one new id: exactly one creates it.
            let barrier = Arc::new(Barrier::new(8));
            let tasks: Vec<_> = (0..8)
                .map(|_| {
                    let (pool, table, barrier) = (f.pool.clone(), f.table.clone(), barrier.clone());
                    tokio::spawn(async move {
                        barrier.wait().await;
                        table
                            .insert_new(&pool, 2i64, |set| {
                                set.value("status", "new").value("counter", 0i64);
                            })
                            .await
                            .unwrap()
                    })
                })
                .collect();
            let mut created = 0;
            for task in tasks {
                if matches!(task.await.unwrap(), InsertOutcome::Created { .. }) {
                    created += 1;
                }
            }
            assert_eq!(created, 1);
            assert_eq!(read(&f, 1).await.unwrap().1.status, "new");
            f.drop_table().await;
        }

        #[tokio::test]
        async fn invalid_identifiers_are_typed_errors() {
            for (table, id, version) in [
                ("payments; DROP TABLE x", "id", "version"),
                ("payments", "id = id --", "version"),
                ("payments", "id", "1version"),
                ("a.b.c", "id", "version"),
            ] {
                let error = VersionedTable::new(table, id, version).unwrap_err();
                assert!(matches!(error, VersionedTableError::InvalidIdentifier { .. }), "{error:?}");
            }
            assert!(matches!(
                VersionedTable::new("payments", "id", "id"),
                Err(VersionedTableError::ReservedColumn { .. })
            ));
            let Some(f) = setup("ident").await else { return };
            create_row(&f, 1, "new").await;
            let bad_column = f
                .table
                .update_if_version(&f.pool, 1i64, Version::INITIAL, |set| {
                    set.value("status = 'x' --", "paid");
                })
                .await
                .unwrap_err();
            assert!(matches!(bad_column, VersionedTableError::InvalidIdentifier { role: "value column", .. }));
            let version_column = f
                .table
                .update_if_version(&f.pool, 1i64, Version::INITIAL, |set| {
                    set.value("version", 99i64);
                })
                .await
                .unwrap_err();
            assert!(matches!(version_column, VersionedTableError::ReservedColumn { .. }));
            let twice = f
                .table
                .update_if_version(&f.pool, 1i64, Version::INITIAL, |set| {
                    set.value("status", "a").value("status", "b");
                })
                .await
                .unwrap_err();
            assert!(matches!(twice, VersionedTableError::DuplicateColumn { .. }));
            let missing_table = VersionedTable::new(&format!("{}_missing", f.name), "id", "version").unwrap();
            let error = missing_table
                .update_if_version(&f.pool, 1i64, Version::INITIAL, |_| {})
                .await
                .unwrap_err();
            assert!(matches!(error, VersionedTableError::Database { .. }), "{error:?}");
            // Nothing was written by the refused statements.
            assert_eq!(read(&f, 1).await.unwrap().0, Version::INITIAL);
            f.drop_table().await;
        }

        /// Unquoted SQL identifiers are case-insensitive on every dialect, so `Version` is
        /// the version column: setting it would corrupt the version (MySQL writes it).
        #[tokio::test]
        async fn reserved_and_duplicate_columns_are_refused_in_any_case() {
            assert!(matches!(
                VersionedTable::new("payments", "id", "ID"),
                Err(VersionedTableError::ReservedColumn { .. })
            ));
            let Some(f) = setup("case").await else { return };
            create_row(&f, 1, "new").await;
            for column in ["Version", "VERSION", "Id", "iD"] {
                let error = f
                    .table
                    .update_if_version(&f.pool, 1i64, Version::INITIAL, |set| {
                        set.value("status", "paid").value(column, 99i64);
                    })
                    .await
                    .unwrap_err();
                assert!(matches!(error, VersionedTableError::ReservedColumn { .. }), "{column}: {error:?}");
                let error = f
                    .table
                    .insert_new(&f.pool, 2i64, |set| {
                        set.value("status", "new").value("counter", 0i64).value(column, 99i64);
                    })
                    .await
                    .unwrap_err();
                assert!(matches!(error, VersionedTableError::ReservedColumn { .. }), "{column}: {error:?}");
            }
            let twice = f
                .table
                .update_if_version(&f.pool, 1i64, Version::INITIAL, |set| {
                    set.value("status", "a").value("STATUS", "b");
                })
                .await
                .unwrap_err();
            assert!(matches!(twice, VersionedTableError::DuplicateColumn { .. }), "{twice:?}");
            // None of the refused statements ran: the row is untouched, no row 2 exists.
            let (version, row) = read(&f, 1).await.unwrap();
            assert_eq!(version, Version::INITIAL);
            assert_eq!((row.status.as_str(), row.version), ("new", 1));
            assert_eq!(read(&f, 2).await, None);
            f.drop_table().await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn retry_on_conflict_in_transactions_loses_no_increment() {
            let Some(f) = setup("retry").await else { return };
            create_row(&f, 1, "new").await;
            const WRITERS: i64 = 6;
            let policy = RetryPolicy::default()
                .max_attempts(200)
                .base_delay(std::time::Duration::from_millis(2))
                .max_delay(std::time::Duration::from_millis(40));
            let barrier = Arc::new(Barrier::new(WRITERS as usize));
            let tasks: Vec<_> = (0..WRITERS)
                .map(|_| {
                    let (pool, table, barrier, policy) =
                        (f.pool.clone(), f.table.clone(), barrier.clone(), policy.clone());
                    tokio::spawn(async move {
                        barrier.wait().await;
                        retry_on_conflict(&policy, || async {
                            let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
                            let (version, row) = table
                                .fetch::<Db, _, _, Payment>(&mut *tx, 1i64)
                                .await
                                .map_err(|e| e.to_string())?
                                .ok_or("row vanished")?;
                            let outcome = table
                                .update_if_version(&mut *tx, 1i64, version, |set| {
                                    set.value("counter", row.counter + 1);
                                })
                                .await
                                .map_err(|e| e.to_string())?;
                            commit_if_updated(tx, outcome).await.map_err(|e| e.to_string())
                        })
                        .await
                    })
                })
                .collect();
            for task in tasks {
                let outcome = task.await.unwrap().unwrap();
                assert!(outcome.is_updated(), "{outcome:?}");
            }
            let (version, row) = read(&f, 1).await.unwrap();
            assert_eq!(row.counter, WRITERS);
            assert_eq!(version, Version::new(1 + WRITERS));
            f.drop_table().await;
        }

        #[tokio::test]
        async fn works_with_connections_and_transactions() {
            let Some(f) = setup("exec").await else { return };
            create_row(&f, 1, "new").await;
            let mut conn = f.pool.acquire().await.unwrap();
            let outcome = f
                .table
                .update_if_version(&mut *conn, 1i64, Version::INITIAL, |set| {
                    set.value("status", "conn");
                })
                .await
                .unwrap();
            assert!(outcome.is_updated());
            drop(conn);
            let mut tx = f.pool.begin().await.unwrap();
            let outcome = f
                .table
                .update_if_version(&mut tx, 1i64, Version::new(2), |set| {
                    set.value("status", "rolled back");
                })
                .await
                .unwrap();
            assert!(outcome.is_updated());
            tx.rollback().await.unwrap();
            let (version, row) = read(&f, 1).await.unwrap();
            assert_eq!((version, row.status.as_str()), (Version::new(2), "conn"));
            f.drop_table().await;
        }
    };
}

/// `Fixture` and `setup` for a backend on a server: a pool for the racers, from the URL in
/// `$env`, and a table made by `$create` (with `{name}` in it) for one test.
macro_rules! server_fixture {
    ($pool:ty, $options:ty, $env:literal, $create:literal) => {
        struct Fixture {
            pool: $pool,
            table: VersionedTable,
            name: String,
        }

        impl Fixture {
            async fn drop_table(self) {
                exec(&self, &format!("DROP TABLE {}", self.name)).await;
            }
        }

        async fn setup(test: &str) -> Option<Fixture> {
            let url = url($env)?;
            let pool = <$options>::new()
                .max_connections(RACERS as u32 + 1)
                .connect(&url)
                .await
                .unwrap();
            let name = table_name(test);
            let table = VersionedTable::new(&name, "id", "version").unwrap();
            let fixture = Fixture { pool, table, name };
            exec(&fixture, &format!($create, name = fixture.name)).await;
            Some(fixture)
        }
    };
}

mod postgres {
    use super::*;
    use sqlx::{PgPool, Postgres as Db};

    server_fixture!(
        PgPool,
        sqlx::postgres::PgPoolOptions,
        "TEST_POSTGRES_URL",
        "CREATE TABLE {name} (id BIGINT PRIMARY KEY, status TEXT NOT NULL, counter BIGINT NOT NULL, version BIGINT NOT NULL)"
    );

    suite!();

    #[tokio::test]
    async fn serializable_transaction_conflict_is_a_conflict() {
        let Some(f) = setup("serial").await else {
            return;
        };
        create_row(&f, 1, "new").await;
        let mut tx = f.pool.begin().await.unwrap();
        exec_in(&mut tx, "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE").await;
        // Take the snapshot, then let another writer commit a new version.
        let seen = f
            .table
            .current_version::<Db, _, _>(&mut *tx, 1i64)
            .await
            .unwrap();
        assert_eq!(seen, Some(Version::INITIAL));
        let other = f
            .table
            .update_if_version(&f.pool, 1i64, Version::INITIAL, |set| {
                set.value("status", "other");
            })
            .await
            .unwrap();
        assert!(other.is_updated());
        let outcome = f
            .table
            .update_if_version(&mut *tx, 1i64, Version::INITIAL, |set| {
                set.value("status", "mine");
            })
            .await
            .unwrap();
        assert!(
            matches!(
                outcome,
                VersionedUpdate::Conflict {
                    current_version: None,
                    reason: ConflictReason::SerializationFailure,
                    ..
                }
            ),
            "{outcome:?}"
        );
        let outcome = commit_if_updated(tx, outcome).await.unwrap();
        assert!(outcome.is_conflict());
        assert_eq!(read(&f, 1).await.unwrap().1.status, "other");
        f.drop_table().await;
    }

    async fn exec_in(tx: &mut sqlx::Transaction<'_, Db>, sql: &str) {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&mut **tx)
            .await
            .unwrap();
    }
}

mod mysql {
    use super::*;
    use sqlx::{MySql as Db, MySqlPool};

    server_fixture!(
        MySqlPool,
        sqlx::mysql::MySqlPoolOptions,
        "TEST_MYSQL_URL",
        "CREATE TABLE {name} (id BIGINT PRIMARY KEY, status VARCHAR(64) NOT NULL, counter BIGINT NOT NULL, version BIGINT NOT NULL) ENGINE=InnoDB"
    );

    suite!();

    #[tokio::test]
    async fn repeatable_read_transaction_sees_the_conflict() {
        let Some(f) = setup("rr").await else { return };
        create_row(&f, 1, "new").await;
        let mut tx = f.pool.begin().await.unwrap();
        // REPEATABLE READ (InnoDB's default): this read fixes the transaction's snapshot.
        let seen = f
            .table
            .current_version::<Db, _, _>(&mut *tx, 1i64)
            .await
            .unwrap();
        assert_eq!(seen, Some(Version::INITIAL));
        let other = f
            .table
            .update_if_version(&f.pool, 1i64, Version::INITIAL, |set| {
                set.value("status", "other");
            })
            .await
            .unwrap();
        assert!(other.is_updated());
        // The snapshot still says version 1, but the update and the follow-up locking read
        // see the committed version 2.
        let again = f
            .table
            .current_version::<Db, _, _>(&mut *tx, 1i64)
            .await
            .unwrap();
        assert_eq!(
            again,
            Some(Version::INITIAL),
            "a plain read in the transaction is stale"
        );
        let outcome = f
            .table
            .update_if_version(&mut *tx, 1i64, Version::INITIAL, |set| {
                set.value("status", "mine");
            })
            .await
            .unwrap();
        assert!(
            matches!(
                outcome,
                VersionedUpdate::Conflict { current_version: Some(v), reason: ConflictReason::VersionMismatch, .. }
                    if v == Version::new(2)
            ),
            "{outcome:?}"
        );
        let _ = commit_if_updated(tx, outcome).await.unwrap();
        assert_eq!(read(&f, 1).await.unwrap().1.status, "other");
        f.drop_table().await;
    }
}

mod sqlite {
    use super::*;
    use sqlx::{
        sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions},
        Sqlite as Db, SqlitePool,
    };

    struct Fixture {
        pool: SqlitePool,
        table: VersionedTable,
        name: String,
        path: std::path::PathBuf,
    }

    impl Fixture {
        async fn drop_table(self) {
            self.pool.close().await;
            for suffix in ["", "-wal", "-shm"] {
                let mut path = self.path.clone().into_os_string();
                path.push(suffix);
                let _ = std::fs::remove_file(path);
            }
        }
    }

    async fn setup(test: &str) -> Option<Fixture> {
        let name = table_name(test);
        let path = std::env::temp_dir().join(format!("{name}.sqlite"));
        let options = SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(std::time::Duration::from_secs(10));
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await
            .unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {name} (id INTEGER PRIMARY KEY, status TEXT NOT NULL, counter INTEGER NOT NULL, version INTEGER NOT NULL)"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let table = VersionedTable::new(&name, "id", "version").unwrap();
        Some(Fixture {
            pool,
            table,
            name,
            path,
        })
    }

    suite!();

    #[tokio::test]
    async fn stale_snapshot_transaction_is_a_conflict() {
        let Some(f) = setup("snap").await else { return };
        create_row(&f, 1, "new").await;
        let mut tx = f.pool.begin().await.unwrap();
        // A deferred transaction's first read fixes its WAL snapshot.
        let seen = f
            .table
            .current_version::<Db, _, _>(&mut *tx, 1i64)
            .await
            .unwrap();
        assert_eq!(seen, Some(Version::INITIAL));
        let other = f
            .table
            .update_if_version(&f.pool, 1i64, Version::INITIAL, |set| {
                set.value("status", "other");
            })
            .await
            .unwrap();
        assert!(other.is_updated());
        let outcome = f
            .table
            .update_if_version(&mut *tx, 1i64, Version::INITIAL, |set| {
                set.value("status", "mine");
            })
            .await
            .unwrap();
        assert!(
            matches!(
                outcome,
                VersionedUpdate::Conflict {
                    reason: ConflictReason::Busy,
                    ..
                }
            ),
            "{outcome:?}"
        );
        let _ = commit_if_updated(tx, outcome).await.unwrap();
        assert_eq!(read(&f, 1).await.unwrap().1.status, "other");
        f.drop_table().await;
    }
}
