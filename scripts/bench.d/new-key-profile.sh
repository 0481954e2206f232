# scripts/bench.d/new-key-profile.sh: "Where a new key's time goes" — allocations per request
# and the callgrind profile of the layer on the memory store, in process (benches/layer_profile:
# the same axum router and handler as benches/layer.rs, no sockets). Instruction counts are
# stable on a noisy machine, unlike times. Takes about a minute once built.
#
# The figures from before the work on issue 11 are kept in new-key-profile.before.md (next to
# this file), so the section shows both.

PROFILE_REQUESTS=${BENCH_PROFILE_REQUESTS:-2000}

# The layer_profile bench binary, built in the release (bench) profile.
layer_profile_bin() {
  cargo bench --quiet --bench layer_profile --no-run --message-format=json 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*layer_profile[^"]*\)".*/\1/p' | tail -n 1
}

# callgrind_instructions BIN KIND OUT: runs KIND requests under callgrind, collecting only the
# request loop; prints the instructions per request.
# The pattern names `drive` exactly: a wildcard would also match its async block, and every
# entry into a matching function toggles collection, so the block's work would go uncounted.
callgrind_instructions() {
  local bin=$1 kind=$2 out=$3
  valgrind --tool=callgrind --callgrind-out-file="$out" --toggle-collect='layer_profile::drive' \
    "$bin" run "$kind" "$PROFILE_REQUESTS" >/dev/null 2>&1
  local total
  total=$(callgrind_annotate "$out" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1; exit }')
  calc "$total / $PROFILE_REQUESTS" "%.0f"
}

# callgrind_top OUT: the ten symbols with the most instructions of their own (self cost), as
# markdown rows: share, instructions per request, symbol.
callgrind_top() {
  callgrind_annotate --inclusive=no "$1" 2>/dev/null |
    awk -v n="$PROFILE_REQUESTS" '
      /^ *[0-9,]+ \(/ && !/PROGRAM TOTALS/ && rows < 10 {
        ir = $1; gsub(",", "", ir)
        share = $0; sub(/^ *[0-9,]+ \( */, "", share); sub(/\).*/, "", share)
        sym = $0; sub(/^ *[0-9,]+ \([^)]*\) */, "", sym); sub(/ \[[^]]*\]$/, "", sym)
        sub(/^[^:]*:/, "", sym)
        if (length(sym) > 110) sym = substr(sym, 1, 107) "..."
        gsub(/\|/, "\\|", sym)
        printf "| %s | %.0f | `%s` |\n", share, ir / n, sym
        rows++
      }'
}

bench_new_key_profile() {
  command -v valgrind >/dev/null || apt_install valgrind
  local bin kind
  bin=$(layer_profile_bin)
  [ -x "$bin" ] || { say "new-key-profile: could not build benches/layer_profile"; return 1; }
  say "new-key-profile: allocations and callgrind, $PROFILE_REQUESTS requests per kind"
  local before=scripts/bench.d/new-key-profile.before.md
  echo "## Where a new key's time goes"
  echo
  echo "In process (\`benches/layer_profile\`: the router and handler of \`benches/layer.rs\`, memory"
  echo "store, no sockets), $PROFILE_REQUESTS requests of each kind on a current-thread runtime."
  echo "\`bare\` is the same router without the layer; \`no-key\` a POST without a key through the"
  echo "layer. Allocations are counted by a counting global allocator (reallocations count as one);"
  echo "instructions by callgrind, collecting only the request loop."
  echo
  echo "| request | allocations per request | bytes allocated per request | instructions per request |"
  echo "|---|---:|---:|---:|"
  local allocs
  allocs=$("$bin")
  for kind in bare new-key replay no-key; do
    local row ir
    row=$(echo "$allocs" | awk -F' *\\| *' -v k="$kind" '$2 == k { print $3 " | " $4 }')
    ir=$(callgrind_instructions "$bin" "$kind" "$WORK/callgrind.$kind")
    echo "| $kind | $row | $ir |"
  done
  echo
  echo "Top 10 symbols of the new-key path by their own instructions (self cost, callgrind),"
  echo "instructions per request:"
  echo
  echo "| share | instructions | symbol |"
  echo "|---:|---:|---|"
  callgrind_top "$WORK/callgrind.new-key"
  echo
  if [ -f "$before" ]; then
    cat "$before"
  fi
}
