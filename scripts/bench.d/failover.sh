# shellcheck shell=bash
# Past one database server (issue 37): PostgreSQL primary failover under Patroni, and MariaDB
# Galera with writes on two nodes, under the fault harness (tests/pg_failover.rs,
# tests/galera.rs), every pairing of setting, fault and mode, with longer loads than CI's; the
# outbox/inbox pipeline across the failover in both settings (tests/pipeline_failover.rs) and
# the inbox with consumers on two Galera nodes (tests/inbox_galera.rs).
# Sourced by scripts/bench (its helpers: say, $WORK). BENCH_ONLY=failover runs only this.
#
# A failing test fails the bench: its assertions are the guarantees, the rows are what each
# run measured on the way.

bench_failover() {
  local status=0
  say "failover: tests/pg_failover.rs (8 runs, ${FAILOVER_SECS:-20} s of keys each)"
  FAILOVER_SECS=${FAILOVER_SECS:-20} TEST_REQUIRE_ALL_BACKENDS=1 \
    cargo test --quiet --all-features --test pg_failover -- --include-ignored --nocapture \
    --test-threads=1 >"$WORK/pg_failover.out" 2>&1 || status=$?
  say "failover: tests/galera.rs (2 runs, ${GALERA_SECS:-20} s of keys each)"
  GALERA_SECS=${GALERA_SECS:-20} TEST_REQUIRE_ALL_BACKENDS=1 \
    cargo test --quiet --all-features --test galera -- --include-ignored --nocapture --test-threads=1 \
    >"$WORK/galera.out" 2>&1 || status=$?
  say "failover: tests/pipeline_failover.rs (2 runs, ${PIPELINE_FAILOVER_SECS:-20} s of payments each)"
  PIPELINE_FAILOVER_SECS=${PIPELINE_FAILOVER_SECS:-20} TEST_REQUIRE_ALL_BACKENDS=1 \
    cargo test --quiet --all-features --test pipeline_failover -- --include-ignored --nocapture \
    --test-threads=1 >"$WORK/pipeline_failover.out" 2>&1 || status=$?
  say "failover: tests/inbox_galera.rs (${INBOX_GALERA_MESSAGES:-400} messages, each twice)"
  INBOX_GALERA_MESSAGES=${INBOX_GALERA_MESSAGES:-400} TEST_REQUIRE_ALL_BACKENDS=1 \
    cargo test --quiet --all-features --test inbox_galera -- --nocapture \
    >"$WORK/inbox_galera.out" 2>&1 || status=$?
  if [ "$status" != 0 ]; then
    tail -n 60 "$WORK/pg_failover.out" "$WORK/galera.out" "$WORK/pipeline_failover.out" \
      "$WORK/inbox_galera.out" >&2
    return "$status"
  fi

  cat <<MD
## Database failover and Galera

**PostgreSQL primary failover** (\`tests/pg_failover.rs\`): a two-node cluster of the test's
own under Patroni 3.0 (etcd for the leader lock, \`ttl\` 5 s, \`loop_wait\` 1 s), HAProxy in
front routing to the node whose \`GET /primary\` answers 200 (checked every 200 ms, sessions
to a node marked down shut). Two \`payments\` processes (lease 2 s) through HAProxy, every key
sent twice at once and retried until final, ${FAILOVER_SECS:-20} s of new keys; 2 s in, the
primary is SIGKILLed whole (Patroni and PostgreSQL), or cut by iptables from its standby, its
lock and the clients (healed 1 s after the promotion). *sync* is Patroni's
\`synchronous_mode\` (the standby in \`synchronous_standby_names\`, \`synchronous_commit = on\`).
Effects are counted in the surviving database. "lost": a 201 whose charge is gone;
"documented": separate-mode doubles of keys in flight during the fault (an effect whose
record the failover cut off); "unknown (settled)": \`503 outcome-unknown\` answers, and the
final status their keys' retries got; "key p50": median time from a key's first copy to its
last answer, before the fault (both copies, 20 ms + 100 ms of handler sleeps each).

| engine, setting | fault | mode | keys | doubles | documented | lost | stuck | differing | unknown (settled) | failover | key p50 |
|---|---|---|---|---|---|---|---|---|---|---|---|
$(sed -n 's/^.*pg-failover-row: //p' "$WORK/pg_failover.out")

**MariaDB Galera, writes on two nodes** (\`tests/galera.rs\`): a three-node cluster of the
test's own, process 0 on node 0 and process 1 on node 1, each key's two copies racing on two
nodes, ${GALERA_SECS:-20} s of new keys, no other fault. Certification failures and
brute-force aborts are the nodes' own counters over the run; "seen" counts every answer the
clients got, retries included.

| cluster | mode | keys | doubles | lost | stuck | certification failures | brute-force aborts | seen |
|---|---|---|---|---|---|---|---|---|
$(sed -n 's/^.*galera-row: //p' "$WORK/galera.out")

**The outbox/inbox pipeline across the failover** (\`tests/pipeline_failover.rs\`): the
pipeline fault harness's processes (\`payments\` with its relay, an \`outbox_relay\`, two
\`receipts\`) on the same Patroni cluster, all through HAProxy, RabbitMQ on the machine's
server, ${PIPELINE_FAILOVER_SECS:-20} s of payments (one key every 200 ms, sent twice); 3 s in,
the primary is SIGKILLed whole. No process is restarted. "vanished": payments answered 201
whose row the failover took; "stray": receipts of no payment a client was told about (an
event relayed from a commit that vanished); "after": receipts written after the promotion;
"commit p50": the median one-row commit through HAProxy on the idle cluster, before the run.

| engine, setting | payments for | payments | receipts | doubles | lost receipts | vanished | stray | unsent | dead-lettered | gave up | failover | after | commit p50 |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
$(sed -n 's/^.*pipeline-failover-row: //p' "$WORK/pipeline_failover.out")

**The inbox on Galera** (\`tests/inbox_galera.rs\`): two consumers of one name, on node 0 and
node 1, one RabbitMQ queue holding every message twice in a row, so the copies race on two
nodes. "aborted": handler statements the cluster rolled back (1213); "attempts spent": the
inbox's failure count, summed; "retried": deliveries given back to the broker.

| cluster | messages | receipts | doubles | duplicates acked | retried | dead-lettered | attempts spent | aborted | certification failures | brute-force aborts |
|---|---|---|---|---|---|---|---|---|---|---|
$(sed -n 's/^.*inbox-galera-row: //p' "$WORK/inbox_galera.out")

Reproduce: \`BENCH_ONLY=failover scripts/bench\`.
MD
}
