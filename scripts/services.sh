# Sourced by scripts/test and scripts/bench: makes sure PostgreSQL, MariaDB, Redis, RabbitMQ and
# NATS (with JetStream) answer on this machine, starting (or, on a bare machine, installing) any that does not, and creates
# the databases the tests use. Idempotent: a running server is left alone.

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

ensure_services() {
  ensure_postgres
  ensure_mariadb
  ensure_redis
  ensure_rabbitmq
  ensure_nats
  export TEST_POSTGRES_URL="${TEST_POSTGRES_URL:-postgres://root@127.0.0.1:5432/test}"
  export TEST_MYSQL_URL="${TEST_MYSQL_URL:-mysql://root@127.0.0.1:3306/test}"
  export TEST_REDIS_URL="${TEST_REDIS_URL:-redis://127.0.0.1:6379}"
  export TEST_AMQP_URL="${TEST_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}"
  export TEST_NATS_URL="${TEST_NATS_URL:-nats://127.0.0.1:4222}"
}
