# shellcheck shell=bash
# The fault harness, long (issue 24, part 4): tests/fault_harness.rs with
# FAULT_HARNESS_SECS=${BENCH_FAULTS_SECONDS:-75} seconds of new keys per store and mode, its
# rows gathered into one table. Sourced by scripts/bench (its helpers: say, $WORK).
# BENCH_ONLY=faults runs only this section and prints it.
#
# Environment (optional): BENCH_FAULTS_SECONDS (seconds of new keys per run, default 75).
#
# A failing run (a double the mode does not explain, a lost, stuck or differing key) prints
# the rows it has and fails the bench: that is a bug, not a figure.

bench_faults() {
  local secs=${BENCH_FAULTS_SECONDS:-75} status=0
  say "fault harness: 5 runs of ${secs} s of new keys each, one after the other"
  # The runs take turns inside the test binary anyway; one test thread keeps the rows in
  # name order.
  FAULT_HARNESS_SECS=$secs TEST_REQUIRE_ALL_BACKENDS=1 \
    cargo test --quiet --all-features --test fault_harness -- --nocapture --test-threads=1 \
    >"$WORK/faults.out" 2>&1 || status=$?
  grep -v '^fault-harness-row:' "$WORK/faults.out" | tail -n 40 | sed 's/^/    /' >&2
  local rows
  rows=$(sed -n 's/^fault-harness-row: //p' "$WORK/faults.out")

  cat <<MD
## Fault harness

Two \`payments\` processes share one store; clients send every key twice at once, one copy
to each process, and retry until a final answer (503, 409 in progress and connection errors
are retried; a copy whose process is dead or silent switches to the other one). Meanwhile a
nemesis injects one fault at a time, 0.3 to 1.2 s apart, on a random process: \`kill\`
(SIGKILL, then a fresh process), \`pause\` (SIGSTOP for the 2 s lease and 0.3 to 1.5 s more,
then SIGCONT), \`conn-kill\` (the server ends every store session of the processes:
\`pg_terminate_backend\`, MariaDB \`KILL\`, Redis \`CLIENT KILL\`; only the example's
sessions, found by their client ports or their private database) and \`commit-kill\` (the
same for sessions inside an open transaction, between the charge and the statement that
carries the \`COMMIT\`: commits whose outcome the owner cannot know). The handler sleeps
20 ms before the charge and 100 ms after it, to widen the windows the faults aim at.
Effects are counted in the database (one charge amount per key); after the run, with the
nemesis stopped, a fresh copy of every key must get its final answer.

- doubles (documented limit): in the separate mode, a key charged twice while a fault hit
  its flight: the effect committed and its record did not (a kill, a cut), or a paused
  owner's lease ran out, another process ran the key, and the owner, fenced when it
  resumed, still answered its own client with its own run ("answered apart"). The README
  documents this limit of the mode; the transactional mode has none (n/a).
- doubles (other), lost (a 2xx whose charge row is missing), stuck (no final answer),
  differing (the copies' final answers differ, outside the documented limit): each fails
  the run.
- outcome-unknown seen: \`503 outcome-unknown\` answers (a commit whose connection broke),
  and the final answers those keys' retries got.

${secs} s of new keys per run, 4 keys in flight at once, on this loaded 2-core machine
(debug builds of the example):

| store | mode | seconds | faults injected | keys | doubles (documented limit) | doubles (other) | lost | stuck | differing | outcome-unknown seen (then answered) |
|---|---|---|---|---|---|---|---|---|---|---|
${rows}

Reproduce: \`BENCH_ONLY=faults scripts/bench\`, or
\`FAULT_HARNESS_SECS=75 cargo test --all-features --test fault_harness -- --nocapture --test-threads=1\`.
MD
  return "$status"
}
