# scripts/bench.d/floor.sh: "The floor" (issue 36) — the library's layer against the least
# any idempotency layer must do (examples/floor/floor_layer.rs) and against no layer, on the
# same JSON charge service (examples/floor/app.rs): instructions per request (callgrind, in
# process), time per request (criterion, in process) and HTTP throughput and p99 (wrk, a new
# key per request, the three subjects interleaved round by round, a fresh process each run).
#
# BENCH_FLOOR_ROUNDS (default 3), BENCH_FLOOR_SECONDS (one wrk run, default 8),
# BENCH_PROFILE_REQUESTS (requests per callgrind run, default 2000).
#
# The budget of the layer over the floor, item by item, is in floor.budget.md beside this
# file (a callgrind attribution done by hand), and shown with the section.

FLOOR_ROUNDS=${BENCH_FLOOR_ROUNDS:-3}
FLOOR_SECONDS=${BENCH_FLOOR_SECONDS:-8}
FLOOR_REQUESTS=${BENCH_PROFILE_REQUESTS:-2000}

# The floor bench binary, built in the release (bench) profile.
floor_bench_bin() {
  cargo bench --quiet --bench floor --no-run --message-format=json 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*\/deps\/floor-[^"]*\)".*/\1/p' | tail -n 1
}

# floor_instructions BIN SUBJECT KIND: instructions per request of KIND (new-key, replay)
# through SUBJECT, collecting only the request loop (see benches/floor.rs).
floor_instructions() {
  local bin=$1 subject=$2 kind=$3 out="$WORK/callgrind.floor.$2.$3" total
  valgrind --tool=callgrind --callgrind-out-file="$out" --toggle-collect='floor::drive' \
    "$bin" run "$subject" "$kind" "$FLOOR_REQUESTS" >/dev/null 2>&1
  total=$(callgrind_annotate "$out" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1; exit }')
  calc "$total / $FLOOR_REQUESTS" "%.0f"
}

# floor_wrk SUBJECT ROUND: one wrk run against a fresh process of the floor example; appends
# "SUBJECT REQ_PER_S P99_MS" to $WORK/floor.wrk. Any answer but a 2xx fails the bench.
floor_wrk() {
  local subject=$1 round=$2 log="$WORK/floor.$1.$2.log" out="$WORK/floor.$1.$2.wrk" url=
  "$BIN/floor" "$subject" >"$log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  for _ in $(seq 1 100); do
    url=$(grep -so 'http://127\.0\.0\.1:[0-9]*' "$log" | head -n 1 || true)
    [ -n "$url" ] && break
    sleep 0.1
  done
  [ -n "$url" ] || { say "floor $subject did not start:"; cat "$log" >&2; return 1; }
  wrk -t1 -c32 -d"${FLOOR_SECONDS}s" --latency -s "$WORK/floor.lua" "$url/payments" >"$out" 2>&1
  stop_payments "$pid"
  if grep -q 'Non-2xx\|Socket errors' "$out"; then
    say "floor $subject: errors or non-2xx answers:"; cat "$out" >&2; return 1
  fi
  local rps p99
  rps=$(awk '/^Requests\/sec:/ { print $2 }' "$out")
  # wrk prints 99% as e.g. 3.91ms, 812.00us or 1.02s.
  p99=$(awk '$1 == "99%" { v = $2; u = v; gsub(/[0-9.]/, "", u); sub(/[a-z]+$/, "", v);
          m = (u == "us") ? 0.001 : (u == "s") ? 1000 : 1; printf "%.2f", v * m }' "$out")
  say "floor: round $round, $subject: $rps req/s, p99 $p99 ms"
  echo "$subject $rps $p99" >>"$WORK/floor.wrk"
}

bench_floor() {
  command -v valgrind >/dev/null || apt_install valgrind
  command -v wrk >/dev/null || apt_install wrk
  say "floor: building"
  cargo build --release --quiet --example floor
  local bin
  bin=$(floor_bench_bin)
  [ -x "$bin" ] || { say "floor: could not build benches/floor"; return 1; }

  # A new key per request; the key's prefix keeps two runs' keys apart.
  cat >"$WORK/floor.lua" <<'LUA'
wrk.method = "POST"
wrk.body = '{"amount":1200,"currency":"EUR"}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer bench"
local prefix = tostring(os.time()) .. "-" .. tostring(math.random(1000000000))
local n = 0
request = function()
  n = n + 1
  wrk.headers["Idempotency-Key"] = prefix .. "-" .. n
  return wrk.format()
end
LUA
  : >"$WORK/floor.wrk"
  local round subject
  for round in $(seq 1 "$FLOOR_ROUNDS"); do
    # Each round in another order, so that no subject always follows the same neighbour.
    local order="bare floor layer"
    [ $((round % 3)) = 2 ] && order="floor layer bare"
    [ $((round % 3)) = 0 ] && order="layer bare floor"
    for subject in $order; do floor_wrk "$subject" "$round"; done
  done

  say "floor: callgrind, $FLOOR_REQUESTS requests per kind"
  local -A IR
  for subject in bare floor layer; do
    for kind in new-key replay; do
      [ "$subject" = bare ] && [ "$kind" = replay ] && continue
      IR[$subject.$kind]=$(floor_instructions "$bin" "$subject" "$kind")
    done
  done

  say "floor: criterion"
  local criterion_dir=${CARGO_TARGET_DIR:-target}/criterion/floor
  rm -rf "$criterion_dir"
  "$bin" --bench --noplot >"$WORK/floor.criterion.log" 2>&1
  local -A US
  local meta name
  for meta in "$criterion_dir"/*/new/benchmark.json; do
    name=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["function_id"])' "$meta")
    US[$name]=$(python3 -c 'import json,sys; print("%.2f" % (json.load(open(sys.argv[1]))["mean"]["point_estimate"] / 1000))' "$(dirname "$meta")/estimates.json")
  done

  # Sums over the rounds: req/s as the mean of the rounds, p99 as the worst round.
  local -A RPS P99
  for subject in bare floor layer; do
    RPS[$subject]=$(awk -v s="$subject" '$1 == s { t += $2; n++ } END { printf "%.0f", t / n }' "$WORK/floor.wrk")
    P99[$subject]=$(awk -v s="$subject" '$1 == s && $3 > m { m = $3 } END { printf "%.2f", m }' "$WORK/floor.wrk")
  done
  local rounds_list
  rounds_list=$(awk '{ printf "%s%s %.0f", (NR > 1 ? ", " : ""), $1, $2 }' "$WORK/floor.wrk")

  echo "## The floor: the layer against the least any idempotency layer must do"
  echo
  echo "The service of issue 36 (\`examples/floor\`: parse a JSON charge, count the execution,"
  echo "answer 201 JSON) bare, behind the *floor* and behind the layer (memory store). The floor"
  echo "(\`examples/floor/floor_layer.rs\`, a bench subject, not the library's API) does per new"
  echo "key only what any idempotency layer must: read the body and hash it (SHA-256), insert the"
  echo "key into a concurrent map (16 mutex shards), buffer the response and keep a copy; a replay"
  echo "answers from that copy. Instructions: callgrind, $FLOOR_REQUESTS requests in process"
  echo "(\`benches/floor.rs\`, current-thread runtime). Under valgrind SHA-256 runs in software"
  echo "(valgrind hides the CPU's SHA extensions), so hashing weighs more there than natively."
  echo "µs: criterion in process (2 worker threads). HTTP: \`wrk -t1 -c32\`, ${FLOOR_SECONDS} s"
  echo "per run, a new key per request, $FLOOR_ROUNDS rounds with the three subjects interleaved,"
  echo "each run a fresh process; req/s is the mean of the rounds, p99 the worst round. wrk and"
  echo "the service share the 2 cores, and the machine was shared with other work (load average"
  echo "$(cut -d' ' -f1-3 /proc/loadavg) at the end of this section): read the ratios."
  echo
  echo "| subject | instructions, new key | instructions, replay | µs, new key | µs, replay | HTTP req/s (new keys) | vs bare | vs floor | HTTP p99 |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
  echo "| bare | ${IR[bare.new-key]} | - | ${US[bare]} | - | ${RPS[bare]} | 1.00x | - | ${P99[bare]} ms |"
  for subject in floor layer; do
    echo "| $subject | ${IR[$subject.new-key]} | ${IR[$subject.replay]} | ${US["$subject, new key"]} | ${US["$subject, replay"]} | ${RPS[$subject]} | $(calc "${RPS[$subject]} / ${RPS[bare]}")x | $(calc "${RPS[$subject]} / ${RPS[floor]}")x | ${P99[$subject]} ms |"
  done
  echo
  echo "Rounds (req/s, in the order run): $rounds_list. A run's p99 here is mostly the"
  echo "neighbours' load (the same subject's p99 moves by 2x from round to round): compare"
  echo "p99s only between runs on a quiet machine. Reproduce: \`BENCH_ONLY=floor scripts/bench\`."
  echo
  local budget=scripts/bench.d/floor.budget.md
  [ -f "$budget" ] && cat "$budget"
  return 0
}
