# shellcheck shell=bash
# Message pipeline (issue 10): outbox relay throughput and inbox consumer throughput, measured
# by examples/pipeline_throughput against real PostgreSQL, RabbitMQ and NATS JetStream.
# Sourced by scripts/bench (its helpers: say, calc, goal, $WORK, $PG_URL, $BIN).
#
# Environment (optional): BENCH_PIPELINE_EVENTS (relay rows, default 20000),
# BENCH_PIPELINE_MESSAGES (messages per consumer run, default 5000), BENCH_PIPELINE_ROUNDS
# (alternating rounds of both consumer arms, default 2), BENCH_PIPELINE_PREFETCH (default 8).

# pipeline_field LINE_PREFIX BROKER KEY: a value from the program's output.
pipeline_field() {
  grep "^$1 broker=$2 " "$WORK/pipeline.out" | tr ' ' '\n' | sed -n "s/^$3=//p"
}

bench_pipeline() {
  say "message pipeline: building examples/pipeline_throughput"
  cargo build --release --quiet --example pipeline_throughput
  say "message pipeline: relay and consumer throughput on RabbitMQ and NATS JetStream"
  DATABASE_URL=$PG_URL AMQP_URL=$TEST_AMQP_URL NATS_URL=$TEST_NATS_URL \
    "$BIN/pipeline_throughput" >"$WORK/pipeline.out"
  sed 's/^/    /' "$WORK/pipeline.out" >&2

  local events batch messages rounds prefetch
  events=$(grep -m1 '^relay ' "$WORK/pipeline.out" | tr ' ' '\n' | sed -n 's/^events=//p')
  batch=$(grep -m1 '^relay ' "$WORK/pipeline.out" | tr ' ' '\n' | sed -n 's/^batch=//p')
  messages=$(grep -m1 '^consume ' "$WORK/pipeline.out" | tr ' ' '\n' | sed -n 's/^messages=//p')
  rounds=$(grep -c '^consume broker=amqp arm=inbox ' "$WORK/pipeline.out")
  prefetch=$(grep -m1 '^consumer ' "$WORK/pipeline.out" | tr ' ' '\n' | sed -n 's/^prefetch=//p')

  echo "## Message pipeline (outbox relay, inbox consumer)"
  echo
  echo "Relay: $events outbox rows committed $batch per transaction by 4 producers while one relay"
  echo "(woken by LISTEN/NOTIFY) publishes them with publisher confirms / JetStream publish acks"
  echo "and marks them sent; events/s from the first commit to the last row marked sent."
  echo
  echo "| broker | producers done | last row sent | relay events/s |"
  echo "|---|---:|---:|---:|"
  local broker
  for broker in amqp nats; do
    echo "| $broker | $(pipeline_field relay $broker produced_s) s | $(pipeline_field relay $broker relayed_s) s | $(pipeline_field relay $broker rate) |"
  done
  echo
  echo "Consumer: $messages pre-published messages per run, handler = one INSERT in a PostgreSQL"
  echo "transaction, then commit and ack; prefetch and concurrency $prefetch; $rounds alternating"
  echo "rounds of each arm, each on a fresh queue / stream. *inbox* adds the dedup claim"
  echo "(\`inbox::Consumer::process\`) in the same transaction. Goal: inbox >= 0.8x without."
  echo
  echo "| broker | without inbox, msg/s | with inbox, msg/s | ratio | goal >= 0.80 |"
  echo "|---|---:|---:|---:|---|"
  local ratio
  for broker in amqp nats; do
    ratio=$(pipeline_field consumer $broker ratio)
    echo "| $broker | $(pipeline_field consumer $broker plain_rate) | $(pipeline_field consumer $broker inbox_rate) | ${ratio}x | $(goal "$ratio" 0.8) |"
  done
  echo
}
