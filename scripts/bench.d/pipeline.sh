# shellcheck shell=bash
# Message pipeline (issue 10): outbox relay throughput and inbox consumer throughput, measured
# by examples/pipeline_throughput against real PostgreSQL, RabbitMQ, NATS JetStream, Kafka
# (tansu) and SQS (moto), in one run.
# Sourced by scripts/bench (its helpers: say, calc, goal, $WORK, $PG_URL, $BIN).
#
# Environment (optional): BENCH_PIPELINE_EVENTS (relay rows, default 20000; SQS:
# BENCH_PIPELINE_SQS_EVENTS, default 2000), BENCH_PIPELINE_MESSAGES (messages per consumer run,
# default 5000; SQS: BENCH_PIPELINE_SQS_MESSAGES, default 1000), BENCH_PIPELINE_ROUNDS
# (alternating rounds of both consumer arms, default 2), BENCH_PIPELINE_PREFETCH (default 8).

# inbox_ceiling ROUNDS CLIENTS: PostgreSQL alone (pgbench, prepared statements like sqlx, no
# broker, no Rust) runs the consumer's handler transaction with and without the inbox's row,
# alternating, ROUNDS rounds of BENCH_CEILING_SECONDS (default 5 s) with CLIENTS clients;
# sets CEILING_PLAIN and CEILING_INBOX (transactions/s summed over the rounds). What the
# dedup row costs there is the least any inbox pays on this machine.
inbox_ceiling() {
  local rounds=$1 clients=$2 p=bench_inbox_ceiling
  psql_q -c "SET client_min_messages = warning" \
    -c "DROP TABLE IF EXISTS ${p}_effects, ${p}_inbox" \
    -c "CREATE TABLE ${p}_effects (seq BIGSERIAL PRIMARY KEY, message_id TEXT NOT NULL, amount BIGINT NOT NULL)"
  # The table as PgInbox::schema_sql writes it (src/inbox/postgres.rs).
  psql_q -c "CREATE TABLE ${p}_inbox (consumer TEXT COLLATE \"C\" NOT NULL,
          message_id TEXT COLLATE \"C\" NOT NULL,
          received_at TIMESTAMPTZ NOT NULL DEFAULT now(), PRIMARY KEY (consumer, message_id))" \
    -c "CREATE INDEX ON ${p}_inbox (received_at)"
  local effect="INSERT INTO ${p}_effects (message_id, amount) VALUES ('m' || :r, 1);"
  printf '%s\n' '\set r random(1, 9000000000000000000)' 'BEGIN;' "$effect" 'COMMIT;' \
    >"$WORK/inbox-plain.sql"
  printf '%s\n' '\set r random(1, 9000000000000000000)' 'BEGIN;' \
    "INSERT INTO ${p}_inbox (consumer, message_id) VALUES ('c', 'm' || :r) ON CONFLICT DO NOTHING;" \
    "$effect" 'COMMIT;' >"$WORK/inbox-claimed.sql"
  local round
  CEILING_PLAIN=0 CEILING_INBOX=0
  for round in $(seq 1 "$rounds"); do
    # ceiling_tps: scripts/bench.d/pg-ceiling.sh; prepared statements, as sqlx sends them.
    CEILING_PLAIN=$(calc "$CEILING_PLAIN + $(ceiling_tps inbox-plain prepared "$clients")")
    CEILING_INBOX=$(calc "$CEILING_INBOX + $(ceiling_tps inbox-claimed prepared "$clients")")
  done
  psql_q -c "DROP TABLE IF EXISTS ${p}_effects, ${p}_inbox"
}

# pipeline_field LINE_PREFIX BROKER KEY: a value from the program's output.
pipeline_field() {
  grep -m1 "^$1 broker=$2 " "$WORK/pipeline.out" | tr ' ' '\n' | sed -n "s/^$3=//p"
}

bench_pipeline() {
  say "message pipeline: building examples/pipeline_throughput"
  cargo build --release --quiet --example pipeline_throughput
  say "message pipeline: relay and consumer throughput on RabbitMQ, NATS JetStream, Kafka and SQS"
  # Four rounds of each consumer arm by default: one round of a few seconds moves by 0.1.
  DATABASE_URL=$PG_URL AMQP_URL=$TEST_AMQP_URL NATS_URL=$TEST_NATS_URL \
    KAFKA_URL=$TEST_KAFKA_URL SQS_URL=$TEST_SQS_URL \
    BENCH_PIPELINE_ROUNDS=${BENCH_PIPELINE_ROUNDS:-4} \
    "$BIN/pipeline_throughput" >"$WORK/pipeline.out"
  sed 's/^/    /' "$WORK/pipeline.out" >&2

  local batch rounds prefetch
  batch=$(grep -m1 '^relay ' "$WORK/pipeline.out" | tr ' ' '\n' | sed -n 's/^batch=//p')
  rounds=$(grep -c '^consume broker=amqp arm=inbox ' "$WORK/pipeline.out")
  prefetch=$(grep -m1 '^consumer ' "$WORK/pipeline.out" | tr ' ' '\n' | sed -n 's/^prefetch=//p')
  say "message pipeline: PostgreSQL alone, the handler's transaction with and without the inbox row"
  inbox_ceiling "$rounds" "$prefetch"

  echo "## Message pipeline (outbox relay, inbox consumer)"
  echo
  echo "Relay: outbox rows committed $batch per transaction by 4 producers while one relay"
  echo "(woken by LISTEN/NOTIFY) publishes them with publisher confirms / JetStream publish acks /"
  echo "Kafka delivery reports (idempotent producer, acks=all) / SendMessageBatch answers, and marks"
  echo "them sent; events/s from the first commit to the last row marked sent. Kafka is tansu, SQS"
  echo "is moto (a Python server): their figures measure those local servers as much as the library."
  echo
  echo "| broker | rows | producers done | last row sent | relay events/s |"
  echo "|---|---:|---:|---:|---:|"
  local broker
  for broker in amqp nats kafka sqs; do
    echo "| $broker | $(pipeline_field relay $broker events) | $(pipeline_field relay $broker produced_s) s | $(pipeline_field relay $broker relayed_s) s | $(pipeline_field relay $broker rate) |"
  done
  echo
  echo "Consumer: pre-published messages per run, handler = one INSERT in a PostgreSQL"
  echo "transaction, then commit and ack; prefetch and concurrency $prefetch; $rounds alternating"
  echo "rounds of each arm, each on a fresh queue / stream / topic, timed from the first delivery"
  echo "(a Kafka member joins its group first). *inbox* adds the dedup claim"
  echo "(\`inbox::Consumer::process\`) in the same transaction. Goal: inbox >= 0.8x without."
  echo
  echo "| broker | messages per run | without inbox, msg/s | with inbox, msg/s | ratio | goal >= 0.80 |"
  echo "|---|---:|---:|---:|---:|---|"
  local ratio
  for broker in amqp nats kafka sqs; do
    ratio=$(pipeline_field consumer $broker ratio)
    echo "| $broker | $(pipeline_field consume $broker messages) | $(pipeline_field consumer $broker plain_rate) | $(pipeline_field consumer $broker inbox_rate) | ${ratio}x | $(goal "$ratio" 0.8) |"
  done
  echo "| PostgreSQL alone (pgbench, $prefetch clients, no broker, no Rust) | | $(calc "$CEILING_PLAIN / $rounds" %.0f) tx/s | $(calc "$CEILING_INBOX / $rounds" %.0f) tx/s | $(calc "$CEILING_INBOX / $CEILING_PLAIN")x | the least any inbox costs here |"
  echo
  echo "The last row is the same two transactions with nothing around them: \`BEGIN\`, the"
  echo "handler's INSERT, \`COMMIT\`, and the same with the inbox's row first (its table and"
  echo "index as \`PgInbox\` makes them), $rounds alternating rounds of ${BENCH_CEILING_SECONDS:-5} s. With a one-INSERT"
  echo "handler, the dedup row is a second indexed INSERT in a transaction that had one, so its"
  echo "share is large; a handler that does more pays a smaller one."
  echo
}
