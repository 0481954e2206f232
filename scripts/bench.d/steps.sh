# shellcheck shell=bash
# Recovery points (issue 35): the cost of a step per store, side by side with a plain keyed
# operation: `cargo bench --bench steps` (criterion, a new key per iteration; PostgreSQL, MySQL /
# MariaDB and Redis when TEST_POSTGRES_URL, TEST_MYSQL_URL, TEST_REDIS_URL are set). Sourced by scripts/bench (its helpers: say, $WORK).

bench_steps() {
  local dir=${CARGO_TARGET_DIR:-target}/criterion
  cargo bench --quiet --bench steps -- --noplot >"$WORK/steps-criterion.log" 2>&1 ||
    { cat "$WORK/steps-criterion.log" >&2; exit 1; }
  local rows
  rows=$(python3 - "$dir" <<'PY'
import json, pathlib, sys
for meta in sorted(pathlib.Path(sys.argv[1]).glob("steps *//*/new/benchmark.json")):
    bench = json.loads(meta.read_text())
    mean = json.loads((meta.parent / "estimates.json").read_text())["mean"]
    us = lambda ns: f"{ns / 1000:.2f} µs"
    ci = mean["confidence_interval"]
    print(f"| {bench['group_id'][6:]} | {bench['function_id']} | **{us(mean['point_estimate'])}** "
          f"({us(ci['lower_bound'])} – {us(ci['upper_bound'])}) |")
PY
)
  cat <<MD
## Recovery points: the cost of a step

\`cargo bench --bench steps\`: one keyed operation per iteration (a new key) through
\`Engine::run_once\` (claim + complete), and through \`Engine::run_steps\` with one foreign step
(plus one journal read and one fenced journal transaction) or one local phase (plus one fenced
transaction holding an insert and the journal entry). Means with 95% intervals.

| store | operation | mean |
|---|---|---|
$rows
MD
}
