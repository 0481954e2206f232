# shellcheck shell=bash
# The pipeline fault harness, long (issue 32): tests/pipeline_faults.rs, every fault kind at
# once, PIPELINE_FAULTS_SECS=${BENCH_PIPELINE_FAULTS_SECONDS:-60} seconds of new payments per
# broker, its rows gathered into one table. Sourced by scripts/bench (its helpers: say, $WORK).
# BENCH_ONLY=pipeline-faults runs only this section and prints it.
#
# Environment (optional): BENCH_PIPELINE_FAULTS_SECONDS (seconds of new payments per broker,
# default 60).
#
# A failing run (a double, a lost payment, an unsent event, a dead letter, a process that gave
# up) prints the rows it has and fails the bench: that is a bug, not a figure.

bench_pipeline_faults() {
  local secs=${BENCH_PIPELINE_FAULTS_SECONDS:-60} status=0
  say "pipeline fault harness: every fault kind, ${secs} s of new payments per broker"
  PIPELINE_FAULTS_SECS=$secs TEST_REQUIRE_ALL_BACKENDS=1 \
    cargo test --quiet --all-features --test pipeline_faults -- --nocapture --test-threads=1 \
    --include-ignored --exact rabbitmq_every_fault nats_every_fault \
    >"$WORK/pipeline-faults.out" 2>&1 || status=$?
  grep -v '^pipeline-faults-row:' "$WORK/pipeline-faults.out" | tail -n 40 | sed 's/^/    /' >&2
  local rows
  rows=$(sed -n 's/^pipeline-faults-row: //p' "$WORK/pipeline-faults.out")

  cat <<MD
## Pipeline faults

The \`payments\` service (its outbox relay inside), a separate \`outbox_relay\` and two
\`receipts\` consumers run as processes on one PostgreSQL schema; clients send every key twice
(half of them at once) and retry until 201. Meanwhile a nemesis injects one fault at a time,
0.3 to 1.2 s apart: \`kill\` (SIGKILL of a process, each in turn, then a fresh one),
\`broker-outage\` (5 s without the broker: on RabbitMQ a proxy of the test's own cuts every
connection of every process and turns new ones away; on NATS the test's own \`nats-server -js\`
is SIGKILLed and restarted on its store), \`database-outage\` (10 s: a proxy in front of
PostgreSQL, the consumers' only way to it, cuts and refuses every connection) and \`poison\`
(1 to 3 outbox rows on a topic the broker refuses). The windows the faults aim at are widened:
100 ms between the charge and its commit, 500 ms between the broker's confirm and the rows
marked sent, 800 ms between a receipt and its commit; the NATS ack wait (500 ms) is shorter
than a handler, so copies overlap.

Counted in the database once the pipeline is quiet: receipts per payment (doubles: more than
one; lost: none), \`payment.created\` rows never sent, poison rows parked (of planted);
dead-lettered: the consumers' dead-letter log lines (RabbitMQ: or the dead-letter queue, if
more); exits: processes that ended without being killed. Every figure but the payments, the
receipts and the parked rows must be 0.

${secs} s of new payments per broker on this loaded 2-core machine (debug builds):

| broker | seconds | faults injected | payments | receipts | doubles | lost | parked | dead-lettered | unsent | exits |
|---|---|---|---|---|---|---|---|---|---|---|
${rows}

Reproduce: \`BENCH_ONLY=pipeline-faults scripts/bench\`, or
\`PIPELINE_FAULTS_SECS=60 cargo test --all-features --test pipeline_faults -- --nocapture --test-threads=1 --include-ignored --exact rabbitmq_every_fault nats_every_fault\`.
MD
  return "$status"
}
