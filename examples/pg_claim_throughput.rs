//! `pg_claim_throughput`: how many NEW keys per second `PostgresStore` handles (claim, then
//! complete, through the `Store` trait) with N concurrent tasks, against the least a
//! hand-written equivalent must do: `INSERT .. ON CONFLICT DO NOTHING` then `UPDATE`, with
//! sqlx, on the same table, at the same concurrency. `scripts/bench` runs it (issue #3's bench).
//!
//! ```text
//! cargo run --release --example pg_claim_throughput -- --tasks 10 --seconds 5 --rounds 2
//! ```
//!
//! The two loops alternate (store, plain, store, plain, ...) so that a neighbour's load on a
//! shared machine hits both alike. It works in a table of its own, dropped at the end.
//! The URL comes from `--url`, else `TEST_POSTGRES_URL`, else `postgres://root@127.0.0.1/test`.

use std::{
    process::ExitCode,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use sqlx::{postgres::PgPoolOptions, PgPool};
use tower_idempotency::{
    store::{PostgresStore, Store},
    ClaimOutcome, Fingerprint, StoreKey, Token,
};

const HELP: &str = "\
pg_claim_throughput: PostgresStore claim + complete vs plain INSERT .. ON CONFLICT + UPDATE

  --url URL       PostgreSQL [default: $TEST_POSTGRES_URL or postgres://root@127.0.0.1/test]
  --tasks N       concurrent tasks, and pool connections [default: 10]
  --seconds S     length of one round of each loop [default: 5]
  --rounds R      rounds of each loop, alternating [default: 2]
  --help";

const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

struct Options {
    url: String,
    tasks: usize,
    round: Duration,
    rounds: u32,
}

fn parse_args() -> Result<Option<Options>, String> {
    let mut options = Options {
        url: std::env::var("TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://root@127.0.0.1/test".to_owned()),
        tasks: 10,
        round: Duration::from_secs(5),
        rounds: 2,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            return Ok(None);
        }
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<u32>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("{flag} must be a positive integer, got {value:?}"))
        };
        match flag.as_str() {
            "--url" => options.url = value.clone(),
            "--tasks" => options.tasks = number()? as usize,
            "--seconds" => options.round = Duration::from_secs(number()?.into()),
            "--rounds" => options.rounds = number()?,
            _ => return Err(format!("unknown option {flag} (see --help)")),
        }
    }
    Ok(Some(options))
}

#[tokio::main]
async fn main() -> ExitCode {
    let options = match parse_args() {
        Ok(Some(options)) => options,
        Ok(None) => {
            println!("{HELP}");
            return ExitCode::SUCCESS;
        }
        Err(error) => {
            eprintln!("pg_claim_throughput: {error}");
            return ExitCode::from(2);
        }
    };
    match run(options).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("pg_claim_throughput: {error}");
            ExitCode::FAILURE
        }
    }
}

type Error = Box<dyn std::error::Error + Send + Sync>;

async fn run(options: Options) -> Result<(), Error> {
    let pool = PgPoolOptions::new()
        .max_connections(options.tasks as u32)
        .connect(&options.url)
        .await?;
    let table = format!("bench_claims_{}", Token::random().to_hex());
    let store = PostgresStore::builder(pool.clone())
        .table(table.as_str())
        .build()?;
    store.migrate().await?;
    let result = compare(&options, &pool, &store, &table).await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&pool)
        .await?;
    result
}

/// What one round measured: keys claimed and completed, and how long it took.
#[derive(Default, Clone, Copy)]
struct Count {
    keys: u64,
    elapsed: Duration,
}

impl Count {
    fn per_second(self) -> f64 {
        self.keys as f64 / self.elapsed.as_secs_f64()
    }
}

impl std::ops::AddAssign for Count {
    fn add_assign(&mut self, other: Self) {
        self.keys += other.keys;
        self.elapsed += other.elapsed;
    }
}

async fn compare(
    options: &Options,
    pool: &PgPool,
    store: &PostgresStore,
    table: &str,
) -> Result<(), Error> {
    let plain = Arc::new(Plain::new(pool.clone(), table));
    let store = Arc::new(store.clone());
    let (mut through_store, mut by_hand) = (Count::default(), Count::default());
    println!(
        "pg_claim_throughput: {} tasks, {} round(s) of {:?} each",
        options.tasks, options.rounds, options.round
    );
    for round in 0..options.rounds {
        let store = store.clone();
        let s = measure(options, move |task, i| {
            let store = store.clone();
            async move { store_new_key(&store, format!("s{round}-{task}-{i}")).await }
        })
        .await?;
        let plain = plain.clone();
        let p = measure(options, move |task, i| {
            let plain = plain.clone();
            async move { plain.new_key(format!("p{round}-{task}-{i}")).await }
        })
        .await?;
        println!(
            "round {}: PostgresStore {:.0} keys/s, plain SQL {:.0} keys/s",
            round + 1,
            s.per_second(),
            p.per_second()
        );
        through_store += s;
        by_hand += p;
    }
    let ratio = through_store.per_second() / by_hand.per_second();
    println!(
        "summary: tasks={} store_keys_per_s={:.1} plain_keys_per_s={:.1} ratio={ratio:.3}",
        options.tasks,
        through_store.per_second(),
        by_hand.per_second()
    );
    Ok(())
}

/// Runs `one(task, i)` in a loop on each of `options.tasks` tasks for one round.
async fn measure<F, Fut>(options: &Options, one: F) -> Result<Count, Error>
where
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), Error>> + Send,
{
    let started = Instant::now();
    let deadline = started + options.round;
    let tasks: Vec<_> = (0..options.tasks)
        .map(|task| {
            let one = one.clone();
            tokio::spawn(async move {
                let mut keys = 0;
                while Instant::now() < deadline {
                    one(task, keys).await?;
                    keys += 1;
                }
                Ok::<_, Error>(keys)
            })
        })
        .collect();
    let mut keys = 0;
    for task in tasks {
        keys += task.await??;
    }
    Ok(Count {
        keys,
        elapsed: started.elapsed(),
    })
}

fn fingerprint() -> Fingerprint {
    Fingerprint::of([b"POST".as_slice(), b"/payments", br#"{"amount": 1200}"#])
}

/// About the size of a stored payments answer (status, headers, JSON body).
fn payload() -> Bytes {
    Bytes::from(vec![b'x'; 256])
}

/// A new key through the store: one claim (which wins), one complete.
async fn store_new_key(store: &PostgresStore, key: String) -> Result<(), Error> {
    let key = StoreKey::new("bench", key);
    let ClaimOutcome::Claimed(token) = store.claim(&key, &fingerprint(), LEASE).await? else {
        return Err(format!("a new key was not claimed: {key:?}").into());
    };
    store.complete(&key, token, payload(), RETENTION).await?;
    Ok(())
}

/// The hand-written floor: the fewest statements that claim a key atomically and record the
/// outcome, with no lease takeover and no replay read.
struct Plain {
    pool: PgPool,
    insert: String,
    update: String,
}

impl Plain {
    fn new(pool: PgPool, table: &str) -> Self {
        Self {
            pool,
            insert: format!(
                "INSERT INTO {table} (scope, key, fingerprint, token, payload, expires_at)
                 VALUES ($1, $2, $3, $4, NULL, now() + interval '30 seconds')
                 ON CONFLICT (scope, key) DO NOTHING"
            ),
            update: format!(
                "UPDATE {table} SET token = NULL, payload = $4, expires_at = now() + interval '1 day'
                 WHERE scope = $1 AND key = $2 AND token = $3"
            ),
        }
    }

    async fn new_key(&self, key: String) -> Result<(), Error> {
        let token = Token::random().to_bytes();
        let inserted = sqlx::query(sqlx::AssertSqlSafe(self.insert.as_str()))
            .bind("bench")
            .bind(&key)
            .bind(fingerprint().as_bytes().as_slice())
            .bind(token.as_slice())
            .execute(&self.pool)
            .await?;
        if inserted.rows_affected() != 1 {
            return Err(format!("a new key was not inserted: {key}").into());
        }
        sqlx::query(sqlx::AssertSqlSafe(self.update.as_str()))
            .bind("bench")
            .bind(&key)
            .bind(token.as_slice())
            .bind(payload().as_ref())
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}
