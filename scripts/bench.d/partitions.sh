# shellcheck shell=bash
# Network partitions between a service and its store, and Redis Cluster failovers (issue 24,
# part 4): tests/fault_partition.rs and the failover tests of tests/store_redis_cluster.rs,
# run once with their figures printed, gathered here. Sourced by scripts/bench (its helpers:
# say, $WORK). BENCH_ONLY=partitions runs only this section and prints it.
#
# A failing test fails the bench: its assertions are the guarantees, the figures are what
# each run measured on the way.

bench_partitions() {
  local status=0
  say "partitions: tests/fault_partition.rs"
  TEST_REQUIRE_ALL_BACKENDS=1 \
    cargo test --quiet --all-features --test fault_partition -- --nocapture --test-threads=1 \
    >"$WORK/partitions.out" 2>&1 || status=$?
  say "failovers: tests/store_redis_cluster.rs (kill and partition of a master)"
  TEST_REQUIRE_ALL_BACKENDS=1 \
    cargo test --quiet --all-features --test store_redis_cluster during_a_storm -- --nocapture \
    --test-threads=1 >"$WORK/failovers.out" 2>&1 || status=$?
  if [ "$status" != 0 ]; then
    tail -n 60 "$WORK/partitions.out" "$WORK/failovers.out" >&2
    return "$status"
  fi

  cat <<MD
## Partitions and Redis failover

**A service cut from its store** (\`tests/fault_partition.rs\`): two \`payments\` processes
share the store; one runs in a network namespace of its own, reaching the store over a veth
link through a proxy. 8 keys are claimed there, their handlers asleep, then the store link is
taken down for longer than the 2 s lease and brought up again, while every key's duplicate
goes to the other process. Effects are counted in the database. \`tc netem\` would add loss;
this machine's kernel has no \`sch_netem\`, so delay is the proxy's and a partition is the
link going down (every packet lost).

$(sed -n 's/^\.*\(postgres\|redis\|store 150 ms away\)\(.*\)$/- \`\1\2\`/p' "$WORK/partitions.out")

The PostgreSQL transactional run has no double: the database ends the cut-off owner's
transaction, the other process charges once, and the cut-off process's clients get that
answer on their retry. The Redis separate run charges every key twice: the effect ran before
the cut, its record could not be written (the separate mode's documented limit, here from a
partition rather than a crash).

**A Redis Cluster master killed, or partitioned** (\`tests/store_redis_cluster.rs\`): a
throw-away 3-master / 3-replica cluster, two layers over their own cluster connections, new
keys every 20 ms, each sent to both. After 1 s the master of a third of the slots is SIGKILLed
(then restarted once its replica was promoted), or cut by iptables from its peers' cluster bus
and its replica's replication link while clients still reach it (healed 1 s after the
promotion). "ran twice" is measured, not asserted, without the replica wait; with
\`wait_for_replicas(1, 100 ms)\` the test asserts it is 0.

$(grep '^|' "$WORK/failovers.out" | awk '!(/^\|---/ && seen++) && !(/^\| victim master/ && header++)')

Reproduce: \`BENCH_ONLY=partitions scripts/bench\`.
MD
}
