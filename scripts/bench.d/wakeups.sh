# shellcheck shell=bash
# Cross-process wake-ups (issue 11, items 3 and 4): the 2-process duplicate storms on Postgres
# and on Redis, with the store's own counters read around them, and statements per request
# from the databases' own counters. Sourced by scripts/bench; uses its helpers.
#
# The counters must see only this run: Postgres runs on a database of its own
# (pg_stat_database is per database; a backend flushes its counters when it exits, so the
# processes are stopped before reading), Redis on a private redis-server (INFO commandstats
# is per server), MariaDB as a user of its own (USER_STATISTICS, with userstat on).

# pg_commits DB: committed transactions (autocommit statements included) and rows returned
# + fetched of database DB so far.
wake_pg_counts() {
  psql_q -c "SELECT pg_stat_clear_snapshot()" \
    -c "SELECT xact_commit || ' ' || (tup_returned + tup_fetched) FROM pg_stat_database WHERE datname = '$1'" | tail -n 1
}

# wake_redis_calls PORT: total command calls on the private server, and the EVALSHA, GET,
# PUBLISH counts, as "total evalsha get publish set".
wake_redis_calls() {
  redis-cli -p "$1" INFO commandstats | tr -d '\r' | awk -F'[:=,]' '
    /^cmdstat_/ { n = substr($1, 9); c[n] = $3; t += $3 }
    END { printf "%d %d %d %d %d", t, c["evalsha"] + c["eval"], c["get"], c["publish"], c["set"] }'
}

# wake_my_counts USER: statements (SELECT + UPDATE + OTHER commands), commits, and rows read
# of MariaDB user USER so far, as "statements commits rows".
wake_my_counts() {
  mysql -h127.0.0.1 -uroot -N -e "SELECT SELECT_COMMANDS + UPDATE_COMMANDS + OTHER_COMMANDS, \
    COMMIT_TRANSACTIONS, ROWS_READ FROM information_schema.USER_STATISTICS WHERE USER = '$1'" \
    | awk 'NF { print $1, $2, $3; found = 1 } END { if (!found) print 0, 0, 0 }'
}

bench_wakeups() {
  psql_q() { psql "$PG_URL" -v ON_ERROR_STOP=1 -qtA "$@"; }
  local db=tower_idempotency_bench_wake
  local db_url="${PG_URL%/*}/$db"
  local requests=$((STORM_COPIES * STORM_KEYS))

  # --- the Postgres storm (transactional mode, the example's default on a database) --------
  psql_q -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db"
  start_payments wake-pg-warm "DATABASE_URL=$db_url"
  stop_payments "$PID"; sleep 1
  local pg_before pg_after
  pg_before=$(wake_pg_counts "$db")
  start_payments wake-pg-1 "DATABASE_URL=$db_url" "PAYMENTS_HANDLER_DELAY_MS=$STORM_DELAY_MS"
  local url1=$URL pid1=$PID
  start_payments wake-pg-2 "DATABASE_URL=$db_url" "PAYMENTS_HANDLER_DELAY_MS=$STORM_DELAY_MS"
  loadgen wake-storm-pg --target "$url1" --target "$URL" --duplicates "$STORM_COPIES" \
    --concurrency 2 --requests "$requests"
  stop_payments "$pid1" "$PID"; sleep 1
  pg_after=$(wake_pg_counts "$db")
  local pg_commits pg_rows
  pg_commits=$(( ${pg_after% *} - ${pg_before% *} ))
  pg_rows=$(( ${pg_after#* } - ${pg_before#* } ))

  # --- the Redis storm (records in Redis; payments in the shared database, so that loadgen's
  # count of charges, read from one process, sees both) ----------------------------------------
  local port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
    >"$WORK/wake-redis-server.log" 2>&1 &
  local redis_pid=$!
  PIDS+=("$redis_pid")
  for _ in $(seq 1 50); do redis-cli -p "$port" PING >/dev/null 2>&1 && break; sleep 0.1; done
  start_payments wake-redis-1 "DATABASE_URL=$db_url" "REDIS_URL=redis://127.0.0.1:$port" "PAYMENTS_HANDLER_DELAY_MS=$STORM_DELAY_MS"
  url1=$URL pid1=$PID
  start_payments wake-redis-2 "DATABASE_URL=$db_url" "REDIS_URL=redis://127.0.0.1:$port" "PAYMENTS_HANDLER_DELAY_MS=$STORM_DELAY_MS"
  local r_before r_after
  r_before=($(wake_redis_calls "$port"))
  loadgen wake-storm-redis --target "$url1" --target "$URL" --duplicates "$STORM_COPIES" \
    --concurrency 2 --requests "$requests"
  r_after=($(wake_redis_calls "$port"))
  stop_payments "$pid1" "$PID"
  local rd=()
  for i in 0 1 2 3 4; do rd[i]=$(( r_after[i] - r_before[i] )); done
  kill "$redis_pid" 2>/dev/null || true; wait "$redis_pid" 2>/dev/null || true

  # --- item 4: statements per request, Postgres, both modes, new keys and replays -----------
  local per_request_rows=""
  local n=1000 arm env kind before after
  for arm in transactional separate; do
    for kind in new replay; do
      env="IDEMPOTENCY_MODE=$arm"
      start_payments "wake-count-$arm-$kind" "DATABASE_URL=$db_url" "$env"
      stop_payments "$PID"; sleep 1
      before=$(wake_pg_counts "$db")
      start_payments "wake-count-$arm-$kind" "DATABASE_URL=$db_url" "$env"
      if [ "$kind" = new ]; then
        loadgen "wake-count-$arm-$kind" --target "$URL" --concurrency 4 --requests "$n"
      else
        # 10 keys for 1000 requests: 99% replays.
        loadgen "wake-count-$arm-$kind" --target "$URL" --concurrency 4 --requests "$n" --key-space 10
      fi
      stop_payments "$PID"; sleep 1
      after=$(wake_pg_counts "$db")
      per_request_rows+="| Postgres, $arm mode, $kind keys ($n requests$([ "$kind" = replay ] && echo ', 10 keys: 99% replays')) | $(calc "(${after% *} - ${before% *}) / $n") commits | $(calc "(${after#* } - ${before#* }) / $n" %.1f) |
"
    done
  done
  psql_q -c "DROP DATABASE IF EXISTS $db"

  # --- item 4 on MariaDB: a user of its own, counted by USER_STATISTICS ---------------------
  local my_rows="" my_user=wake_bench userstat
  userstat=$(mysql -h127.0.0.1 -uroot -N -e "SELECT @@userstat")
  mysql -h127.0.0.1 -uroot -e "SET GLOBAL userstat = 1; DROP DATABASE IF EXISTS $db; \
    CREATE DATABASE $db; DROP USER IF EXISTS '$my_user'@'%'; CREATE USER '$my_user'@'%'; \
    GRANT ALL ON $db.* TO '$my_user'@'%'"
  local my_url="mysql://$my_user@127.0.0.1:3306/$db"
  for arm in transactional separate; do
    for kind in new replay; do
      env="IDEMPOTENCY_MODE=$arm"
      start_payments "wake-my-$arm-$kind" "DATABASE_URL=$my_url" "$env"
      stop_payments "$PID"; sleep 1
      before=($(wake_my_counts "$my_user"))
      start_payments "wake-my-$arm-$kind" "DATABASE_URL=$my_url" "$env"
      if [ "$kind" = new ]; then
        loadgen "wake-my-$arm-$kind" --target "$URL" --concurrency 4 --requests "$n"
      else
        loadgen "wake-my-$arm-$kind" --target "$URL" --concurrency 4 --requests "$n" --key-space 10
      fi
      stop_payments "$PID"; sleep 1
      after=($(wake_my_counts "$my_user"))
      my_rows+="| MariaDB, $arm mode, $kind keys ($n requests$([ "$kind" = replay ] && echo ', 10 keys: 99% replays')) | $(calc "(${after[0]} - ${before[0]}) / $n") statements, $(calc "(${after[1]} - ${before[1]}) / $n") commits | $(calc "(${after[2]} - ${before[2]}) / $n" %.1f) |
"
    done
  done
  mysql -h127.0.0.1 -uroot -e "DROP DATABASE IF EXISTS $db; DROP USER IF EXISTS '$my_user'@'%'; \
    SET GLOBAL userstat = $userstat"

  cat <<MD
## Cross-process wake-ups

Two processes of the payments example share one store; loadgen sends $STORM_COPIES copies of
each of $STORM_KEYS keys spread over both (handler ${STORM_DELAY_MS} ms), so most copies wait
for an original running in the other process. On PostgreSQL (the transactional mode) each
process's watch of a key blocks on the owner's advisory lock, on a connection of its own (at
most 4 per process), and wakes when the owner's transaction ends; the commit notifies nobody.
On Redis the completion script \`PUBLISH\`es to one subscriber per process. Each process then
looks once per key (one watch per key per process, shared by all its waiters). Polling (100
ms doubling to 1 s) only backs up a wait that could not block or a lost notification.

| storm | executions | later copies after the fastest | store work during the storm (the server's own counters) |
|---|---|---|---|
| 2 processes, one Postgres (transactional mode), $STORM_COPIES copies x $STORM_KEYS keys | $(field wake-storm-pg charges) charges for $(field wake-storm-pg keys) keys | p50 **$(field wake-storm-pg lag_p50_ms) ms**, p99 **$(field wake-storm-pg lag_p99_ms) ms**, max $(field wake-storm-pg lag_max_ms) ms | \`pg_stat_database\` of a database of its own: $pg_commits committed transactions/statements = **$(calc "$pg_commits / $STORM_KEYS" %.1f) per key** ($(calc "$pg_commits / $requests") per request), $pg_rows rows read |
| 2 processes, one Redis, $STORM_COPIES copies x $STORM_KEYS keys | $(field wake-storm-redis charges) charges for $(field wake-storm-redis keys) keys | p50 **$(field wake-storm-redis lag_p50_ms) ms**, p99 **$(field wake-storm-redis lag_p99_ms) ms**, max $(field wake-storm-redis lag_max_ms) ms | \`INFO commandstats\` of a private server: ${rd[0]} commands = **$(calc "${rd[0]} / $STORM_KEYS" %.1f) per key** (SET ${rd[4]}, EVALSHA ${rd[1]}, GET ${rd[2]}, PUBLISH ${rd[3]}) |

Statements per request from the databases' own counters, the payments handler's own
transaction included; starts (migrations, pool warm-up) are measured apart and left out.
PostgreSQL: \`pg_stat_statements\` is not loaded on this server, so \`pg_stat_database\` of a
database used by nothing else, where every autocommit statement and every transaction counts
one commit. MariaDB: \`information_schema.USER_STATISTICS\` (\`userstat\`) of a user used by
nothing else (SELECT + UPDATE + other commands).

| workload | per request | rows read per request |
|---|---|---|
${per_request_rows}${my_rows}
MD
}
