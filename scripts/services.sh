#!/usr/bin/env bash
# Makes sure PostgreSQL (127.0.0.1:5432) and RabbitMQ (127.0.0.1:5672) answer: uses them when
# they already do, otherwise installs them from Debian's packages if missing and starts them.
# Also installs `promtool` (Debian's `prometheus` package; nothing is started) for the alert
# rule tests, and `faketime` (Debian's package) for the tests of an operator whose clock is
# wrong. Fails loudly, naming the service, when one cannot be brought up.
set -euo pipefail

PG_HOST=127.0.0.1 PG_PORT=5432 AMQP_PORT=5672
log() { printf 'services: %s\n' "$*" >&2; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for() { # name, seconds, command...
  local name=$1 secs=$2; shift 2
  local deadline=$((SECONDS + secs))
  until "$@"; do
    if ((SECONDS >= deadline)); then
      log "$name did not answer within ${secs}s"
      return 1
    fi
    sleep 1
  done
}

apt_install() {
  if [[ $(id -u) -ne 0 ]]; then
    log "cannot install $* without root; install them and re-run"
    return 1
  fi
  log "installing $* from Debian's packages"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

pg_ready() { pg_isready -q -h "$PG_HOST" -p "$PG_PORT"; }

ensure_postgres() {
  if command -v pg_isready >/dev/null && pg_ready; then
    log "PostgreSQL answers on $PG_HOST:$PG_PORT"
    return
  fi
  if ! command -v pg_ctlcluster >/dev/null || [[ -z $(ls /etc/postgresql 2>/dev/null) ]]; then
    apt_install postgresql postgresql-client
  fi
  local version
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  local conf=/etc/postgresql/$version/main
  # Tests connect as postgres over TCP without a password, like the development machines.
  if ! grep -q '^host all all 127.0.0.1/32 trust' "$conf/pg_hba.conf"; then
    sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$conf/pg_hba.conf"
  fi
  log "starting PostgreSQL $version"
  pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  wait_for PostgreSQL 60 pg_ready
  log "PostgreSQL answers on $PG_HOST:$PG_PORT"
}

ensure_rabbitmq() {
  if port_open "$AMQP_PORT" && rabbitmq-diagnostics -q ping >/dev/null 2>&1; then
    log "RabbitMQ answers on 127.0.0.1:$AMQP_PORT"
    return
  fi
  if ! command -v rabbitmq-server >/dev/null; then
    apt_install rabbitmq-server
  fi
  log "starting RabbitMQ"
  rabbitmq-server -detached >/dev/null 2>&1 || true
  wait_for RabbitMQ 120 port_open "$AMQP_PORT"
  wait_for "RabbitMQ (ping)" 60 rabbitmq-diagnostics -q ping
  log "RabbitMQ answers on 127.0.0.1:$AMQP_PORT"
}

# promtool tests the alert rules (scripts/check-observability.sh). Installing the package does
# not start a Prometheus server where services are not started by the package manager
# (policy-rc.d, no systemd); where they are, it is stopped again.
ensure_promtool() {
  if command -v promtool >/dev/null; then
    return
  fi
  apt_install prometheus
  if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
    systemctl stop prometheus prometheus-node-exporter 2>/dev/null || true
  fi
  command -v promtool >/dev/null || { log "promtool missing after installing prometheus"; return 1; }
}

# nudgectl's tests run it under a wrong clock (faketime) to prove that what it writes and
# reads is dated by the database.
ensure_faketime() {
  command -v faketime >/dev/null || apt_install faketime
  command -v faketime >/dev/null || { log "faketime missing after installing it"; return 1; }
}

ensure_postgres
ensure_rabbitmq
ensure_promtool
ensure_faketime
