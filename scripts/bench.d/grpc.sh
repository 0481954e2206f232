# shellcheck shell=bash
# gRPC unary calls (issue 22): examples/grpc_payments on the memory store with the layer vs
# IDEMPOTENCY_DISABLED=1, driven by examples/grpc_loadgen (a tonic client loop, a new key per
# call), alternating rounds in this one run. Sourced by scripts/bench (its helpers: say, calc,
# $WORK, $BIN, $ROUNDS, $SECONDS_PER_RUN, $CONCURRENCY, PIDS).

# grpc_run NAME [VAR=value ...]: one fresh grpc_payments process, one loadgen run; prints
# "requests seconds errors".
grpc_run() {
  local name=$1; shift
  local log="$WORK/$name.log"
  env -u DATABASE_URL -u IDEMPOTENCY_DISABLED -u PAYMENTS_HANDLER_DELAY_MS \
    RUST_LOG=warn,grpc_payments=info BIND=127.0.0.1:0 NO_COLOR=1 "$@" "$BIN/grpc_payments" >"$log" 2>&1 &
  local pid=$! addr=
  PIDS+=("$pid")
  for _ in $(seq 1 300); do
    addr=$(grep -so 'http://127\.0\.0\.1:[0-9]*' "$log" | head -n 1 | sed 's|http://||' || true)
    [ -n "$addr" ] && break
    sleep 0.1
  done
  [ -n "$addr" ] || { say "grpc_payments ($name) did not start:"; cat "$log" >&2; exit 1; }
  "$BIN/grpc_loadgen" --target "$addr" --concurrency "$CONCURRENCY" --duration "$SECONDS_PER_RUN" \
    >"$WORK/$name.out" 2>&1 || { cat "$WORK/$name.out" >&2; exit 1; }
  kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
  local line; line=$(grep '^summary:' "$WORK/$name.out")
  say "grpc $name: $line"
  echo "$line" | tr ' ' '\n' | sed -n 's/^\(requests\|seconds\|errors\)=//p' | tr '\n' ' '
}

bench_grpc() {
  cargo build --release --quiet --example grpc_payments --example grpc_loadgen
  local req_a=0 sec_a=0 req_b=0 sec_b=0 errors=0 r s e
  for round in $(seq 1 "$ROUNDS"); do
    read -r r s e <<<"$(grpc_run "grpc-b$round" IDEMPOTENCY_DISABLED=1)"
    req_b=$((req_b + r)); sec_b=$(calc "$sec_b + $s" %.3f); errors=$((errors + e))
    read -r r s e <<<"$(grpc_run "grpc-a$round")"
    req_a=$((req_a + r)); sec_a=$(calc "$sec_a + $s" %.3f); errors=$((errors + e))
  done
  if [ "$errors" != 0 ]; then say "grpc: $errors calls failed"; exit 1; fi
  local rps_a rps_b
  rps_a=$(calc "$req_a / $sec_a" %.0f); rps_b=$(calc "$req_b / $sec_b" %.0f)
  cat <<MD
## gRPC unary calls

\`examples/grpc_payments\` (tonic, memory store) driven by \`examples/grpc_loadgen\` ($CONCURRENCY tasks over 4 HTTP/2 connections, a new \`idempotency-key\` per call), $ROUNDS alternating rounds of ${SECONDS_PER_RUN} s, each on a fresh process.

| measure | result | ratio |
|---|---|---|
| gRPC \`Charge\` calls, layer vs \`IDEMPOTENCY_DISABLED=1\` | $rps_a calls/s with the layer vs $rps_b calls/s without | **$(calc "$rps_a / $rps_b")x** |
MD
}
