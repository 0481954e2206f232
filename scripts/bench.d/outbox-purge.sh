# shellcheck shell=bash
# Sent outbox rows under sustained load (issue 32): the relay purges on its schedule even when
# every batch it takes is full. Runs tests/outbox_relay.rs's
# sent_rows_stay_bounded_while_every_batch_is_full for OUTBOX_LOAD_SECS (default 600) instead
# of CI's 3 s. Sourced by scripts/bench (its helpers: say, $WORK). BENCH_ONLY=outbox-purge runs
# only this. A failing test fails the bench: its assertions are the guarantee.

bench_outbox_purge() {
  local secs=${OUTBOX_LOAD_SECS:-600} status=0
  say "outbox-purge: ${secs} s of a relay that never runs out of rows"
  OUTBOX_LOAD_SECS=$secs TEST_REQUIRE_ALL_BACKENDS=1 \
    cargo test --quiet --all-features --test outbox_relay sent_rows_stay_bounded_while_every_batch_is_full \
    -- --nocapture >"$WORK/outbox_purge.out" 2>&1 || status=$?
  if [ "$status" != 0 ]; then
    tail -n 40 "$WORK/outbox_purge.out" >&2
    return "$status"
  fi
  local line
  line=$(grep -o 'outbox-purge: .*' "$WORK/outbox_purge.out" | tail -n 1)
  field() { sed -n "s/.* $1=\([0-9]*\).*/\1/p" <<<"$line"; }

  cat <<MD
## Outbox: sent rows under sustained load

A PostgreSQL outbox whose relay never finds an empty batch: a producer tops the backlog up
by 50 rows per transaction whenever fewer than 300 wait, the relay takes batches of 10 and
publishes them to RabbitMQ with confirms, 20 ms slower than the broker alone; \`sent_retention\` 0, \`purge_every\`
200 ms. Table sampled every 50 ms (\`tests/outbox_relay.rs\`,
\`sent_rows_stay_bounded_while_every_batch_is_full\`, OUTBOX_LOAD_SECS=$secs).

| load | rows sent | most sent rows in the table | most rows in the table | least backlog |
|---:|---:|---:|---:|---:|
| $(field secs) s | $(field sent) | $(field most_sent_rows) | $(field most_rows) | $(field least_backlog) |

Before issue 32 the purge ran only after a drain found no row due, which under this load is
never: the sent rows were all still there at the end.
MD
}
