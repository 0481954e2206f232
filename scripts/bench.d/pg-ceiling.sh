# shellcheck shell=bash
# PostgreSQL's own share of the transactional mode (issue 8): pgbench runs the payments
# handler's transaction alone, and the same transaction with the claim and the record the
# layer adds, in the same round trips the layer uses (the claim rides on the BEGIN, the
# record on the COMMIT). No HTTP, no Rust: the ratio is the most any library could reach on
# this machine. And what a NOTIFY at commit costs, which is why the mode's commits send none.
# Sourced by scripts/bench (its helpers: say, calc, psql_q, $WORK, $PG_URL, $ROUNDS).
#
# Environment (optional): BENCH_CEILING_SECONDS (one pgbench run, default 5).

# ceiling_tps SCRIPT [PROTOCOL] [CLIENTS]: transactions per second of one pgbench run of
# $WORK/SCRIPT.sql (default: simple protocol, $PG_CONCURRENCY clients). The pipeline section
# uses it too.
ceiling_tps() {
  pgbench "$PG_URL" -n -M "${2:-simple}" -c "${3:-$PG_CONCURRENCY}" -j 2 -T "${BENCH_CEILING_SECONDS:-5}" \
    -f "$WORK/$1.sql" >"$WORK/ceiling-$1.pgbench" 2>&1 || { cat "$WORK/ceiling-$1.pgbench" >&2; exit 1; }
  sed -n 's/^tps = \([0-9.]*\).*/\1/p' "$WORK/ceiling-$1.pgbench" | head -n 1
}

bench_pg_ceiling() {
  say "PostgreSQL ceiling: the handler's transaction with and without the claim and the record"
  local p=bench_ceiling
  psql_q -c "SET client_min_messages = warning" \
    -c "DROP TABLE IF EXISTS ${p}_charges, ${p}_payments, ${p}_records, ${p}_notes" \
    -c "CREATE TABLE ${p}_payments (id TEXT PRIMARY KEY, amount BIGINT NOT NULL,
          currency CHAR(3) NOT NULL, status TEXT NOT NULL, version BIGINT NOT NULL,
          created_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP)" \
    -c "CREATE TABLE ${p}_charges (id TEXT PRIMARY KEY,
          payment_id TEXT NOT NULL REFERENCES ${p}_payments (id), amount BIGINT NOT NULL,
          currency CHAR(3) NOT NULL, created_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP)" \
    -c "CREATE TABLE ${p}_notes (id BIGSERIAL PRIMARY KEY, note TEXT NOT NULL)"
  # The records table as PostgresStore::schema_sql writes it (src/store/postgres.rs).
  psql_q -c "CREATE TABLE ${p}_records (
          scope TEXT COLLATE \"C\" NOT NULL, key TEXT COLLATE \"C\" NOT NULL, fingerprint BYTEA NOT NULL, token BYTEA,
          payload BYTEA, expires_at TIMESTAMPTZ NOT NULL, PRIMARY KEY (scope, key),
          CHECK ((token IS NULL) <> (payload IS NULL)))" \
    -c "CREATE INDEX ON ${p}_records (expires_at)"
  local handler="INSERT INTO ${p}_payments (id, amount, currency, status, version) VALUES ('p' || :r, 1, 'EUR', 'pending', 1);
INSERT INTO ${p}_charges (id, payment_id, amount, currency) VALUES ('c' || :r, 'p' || :r, 1, 'EUR');"
  # pgbench sends a line with '\;' as one query: one round trip, as the layer does.
  cat >"$WORK/bare.sql" <<SQL
\set r random(1, 9000000000000000000)
BEGIN;
$handler
COMMIT;
SQL
  # The layer's claim of a new key (src/transactional/postgres.rs, begin_claim) and its record,
  # as it sends them.
  local this_key="scope = 'pgbench' AND key = 'k' || :r"
  local select="SELECT pg_try_advisory_xact_lock(:h, 7) AS got, EXISTS (SELECT 1 FROM ${p}_records WHERE $this_key AND expires_at > clock_timestamp()) AS live"
  local delete="DELETE FROM ${p}_records WHERE $this_key AND expires_at <= clock_timestamp() AND pg_try_advisory_xact_lock(:h, 7)"
  local record="INSERT INTO ${p}_records (scope, key, fingerprint, token, payload, expires_at) VALUES ('pgbench', 'k' || :r, sha256('fp'::bytea), NULL, convert_to(repeat('x', 190), 'UTF8'), clock_timestamp() + interval '1 day')"
  cat >"$WORK/layered.sql" <<SQL
\set r random(1, 9000000000000000000)
\set h random(-2000000000, 2000000000)
BEGIN \; SET LOCAL idle_in_transaction_session_timeout = 30000 \; $select \; $delete;
$handler
$record \; COMMIT;
SQL
  # The same statements one per round trip, as bound statements would need (BEGIN, claim, two INSERTs, record, COMMIT: 6 round trips).
  cat >"$WORK/separate-trips.sql" <<SQL
\set r random(1, 9000000000000000000)
\set h random(-2000000000, 2000000000)
BEGIN \; SET LOCAL idle_in_transaction_session_timeout = 30000;
$select \; $delete;
$handler
$record;
COMMIT;
SQL
  cat >"$WORK/quiet.sql" <<SQL
BEGIN;
INSERT INTO ${p}_notes (note) VALUES ('x');
COMMIT;
SQL
  cat >"$WORK/notifying.sql" <<SQL
BEGIN;
INSERT INTO ${p}_notes (note) VALUES ('x');
SELECT pg_notify('${p}_channel', 'x');
COMMIT;
SQL
  local round bare=0 layered=0 trips=0 quiet=0 notifying=0
  for round in $(seq 1 "$ROUNDS"); do
    bare=$(calc "$bare + $(ceiling_tps bare)")
    layered=$(calc "$layered + $(ceiling_tps layered)")
    trips=$(calc "$trips + $(ceiling_tps separate-trips)")
    quiet=$(calc "$quiet + $(ceiling_tps quiet)")
    notifying=$(calc "$notifying + $(ceiling_tps notifying)")
  done
  psql_q -c "DROP TABLE IF EXISTS ${p}_charges, ${p}_payments, ${p}_records, ${p}_notes"
  local seconds=${BENCH_CEILING_SECONDS:-5}

  echo "## PostgreSQL's own share of the transactional mode"
  echo
  echo "pgbench, $PG_CONCURRENCY clients, $ROUNDS alternating rounds of ${seconds} s, simple protocol; no HTTP and"
  echo "no Rust, so each ratio is the most any code on top could reach on this machine."
  echo
  echo "| what | transactions/s | ratio |"
  echo "|---|---:|---:|"
  echo "| the payments handler's transaction (BEGIN, two INSERTs, COMMIT: 4 round trips) | $(calc "$bare / $ROUNDS" %.0f) | 1.00x |"
  echo "| the same with the layer's claim on the BEGIN and its record on the COMMIT (still 4 round trips) | $(calc "$layered / $ROUNDS" %.0f) | **$(calc "$layered / $bare")x** (ceiling of the layer's ratio above) |"
  echo "| the same statements, claim and record each in a round trip of its own, as bound statements need (6 round trips) | $(calc "$trips / $ROUNDS" %.0f) | **$(calc "$trips / $bare")x** (why the claim and the record travel as text) |"
  echo "| a one-row INSERT transaction | $(calc "$quiet / $ROUNDS" %.0f) | 1.00x |"
  echo "| the same transaction sending a NOTIFY | $(calc "$notifying / $ROUNDS" %.0f) | **$(calc "$notifying / $quiet")x** (why the mode's commits notify nobody) |"
  echo
  # A before/after of a change to the mode, measured side by side by scripts/compare-commits
  # (kept: the old commit is not rebuilt on every bench run).
  local kept=scripts/bench.d/pg-ceiling.before-after.md
  if [ -f "$kept" ]; then cat "$kept"; echo; fi
}
