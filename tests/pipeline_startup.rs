//! Examples are what users copy, so they start the way a deploy starts them: six `receipts`
//! consumers and two `payments` services launched at the same moment on a fresh PostgreSQL
//! schema all come up (their tables are created under the library's advisory lock, not by
//! racing `CREATE TABLE IF NOT EXISTS`), and a consumer whose broker is not reachable yet
//! waits for it instead of exiting.
//!
//! Needs TEST_POSTGRES_URL, TEST_AMQP_URL and the example binaries (`scripts/test` builds
//! them).

mod pipeline;
mod process;

#[path = "common/proxy.rs"]
mod proxy;

use std::time::Duration;

use pipeline::{with_empty_schema, TestBroker};
use process::{worker::Worker, Launch};
use proxy::Proxy;

const CONSUMING: &str = "receipts: consuming";

/// `receipts` processes started together (beside two `payments`): the issue saw the race
/// with three; more make a racing create likelier to show in every run.
const CONSUMERS: usize = 6;

// mutant: `receipts` creates its table with a plain `CREATE TABLE IF NOT EXISTS` and does not
// retry its start (the code before) -> fails with "the example exited with exit status: 1
// before logging \"receipts: consuming\": ... duplicate key value violates unique constraint
// \"pg_type_typname_nsp_index\"" (6 runs of 7: the race needs two creates to overlap).
#[tokio::test]
async fn eight_processes_started_at_once_on_a_fresh_schema_all_come_up() {
    let Some(broker) = TestBroker::amqp() else {
        return;
    };
    with_empty_schema(broker, |shared, broker| async move {
        let mut env = shared.env();
        env.extend(broker.env());
        let launch = Launch::new().envs(&env);
        let (consumers, p, q) = tokio::join!(
            futures_util::future::join_all(
                (0..CONSUMERS).map(|_| Worker::start("receipts", &env, CONSUMING))
            ),
            launch.clone().start(),
            launch.clone().start(),
        );
        for worker in consumers {
            assert!(worker.terminate().await, "a consumer did not stop cleanly");
        }
        for server in [p, q] {
            assert!(server.terminate().await.success());
        }
    })
    .await;
}

// mutant: `receipts` connects its subscriber once (no `retry_start`) -> fails with "the
// example exited with exit status: 1 before logging \"receipts: consuming\"" (lapin: the
// connection was closed).
#[tokio::test]
async fn a_consumer_started_before_its_broker_waits_for_it() {
    let Some(broker) = TestBroker::amqp() else {
        return;
    };
    with_empty_schema(broker, |shared, broker| async move {
        let TestBroker::Amqp { url, .. } = &broker else {
            unreachable!()
        };
        let upstream = "127.0.0.1:5672";
        assert!(url.contains(upstream), "{url}");
        let proxy = Proxy::start("127.0.0.1", 5672).await;
        proxy.cut();
        let mut env = shared.env();
        env.extend(broker.env());
        for (name, value) in &mut env {
            if name == "AMQP_URL" {
                *value = value.replacen(upstream, &proxy.addr().to_string(), 1);
            }
        }
        let restore = async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            assert!(
                proxy.turned_away() > 0,
                "the consumer never tried the broker"
            );
            proxy.restore();
        };
        let (worker, ()) = tokio::join!(Worker::start("receipts", &env, CONSUMING), restore);
        assert!(
            worker.terminate().await,
            "the consumer did not stop cleanly"
        );
    })
    .await;
}
