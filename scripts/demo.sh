#!/usr/bin/env bash
# The whole system on this machine, without Docker: a fresh database `nudge_demo`, the provider
# stub on 127.0.0.1, the producer, the janitor, the three channel workers and the intake, then
# about 300 reminders due over the next 10 s posted to the intake over HTTP
# (scripts/demo-run.sh), watched until nothing is owed.
# Every process it starts is stopped on exit, Ctrl-C and a closed output pipe (`| head`)
# included; exit status 0 when the provider stub accepted every delivery in time (120 s).
#
# Needs: PostgreSQL and RabbitMQ on 127.0.0.1 (scripts/services.sh starts them, installing
# them when missing and run as root), psql, curl, jq, and the binaries (built in debug with
# cargo when missing from target/debug; NUDGE_BIN_DIR=DIR uses other ones, e.g. target/release).
#
# What it leaves: nothing running. The database nudge_demo stays for inspection (the next run
# drops it). Its queues (demo.work.*, demo.dead.*) are deleted when rabbitmqctl is at hand; the
# two exchanges (demo.nudge.work, demo.nudge.dead) stay: empty, and declared again by the next
# run. Logs are removed on success and kept (their path printed) on failure.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
# NUDGE_BIN_DIR chooses the binaries; it is read before every NUDGE_* variable is unset.
bin_dir_wanted=${NUDGE_BIN_DIR:-}
# The configuration is the file written below; NUDGE_* variables would override it.
while read -r var; do unset "$var"; done < <(compgen -e | grep '^NUDGE_' || true)

DB=nudge_demo
NAMESPACE=demo.
PG="env PGOPTIONS=--client-min-messages=warning psql -h 127.0.0.1 -U postgres -v ON_ERROR_STOP=1 -q"
started_at=$SECONDS

say() { printf 'demo.sh: %s\n' "$*"; }
die() { printf 'demo.sh: error: %s\n' "$*" >&2; exit 1; }

for tool in psql curl jq flock openssl; do
  command -v "$tool" >/dev/null || die "$tool is needed (apt-get install postgresql-client curl jq)"
done

# One demo at a time: a second would drop the first one's database and delete its queues.
exec 9>"${TMPDIR:-/tmp}/nudge-demo.lock"
flock -n 9 || die "another scripts/demo.sh is running"

work=$(mktemp -d -t nudge-demo.XXXXXX)
pids=() names=() run_pid=

stop_all() {
  local status=$?
  trap - EXIT INT TERM PIPE
  # Output may be a closed pipe (`scripts/demo.sh | head`): a write must fail, not kill the
  # cleanup half-way, and what is left to say goes to stderr.
  trap '' PIPE
  ((status == 141)) && exec >&2
  set +e
  [[ -n $run_pid ]] && kill -TERM "$run_pid" 2>/dev/null && wait "$run_pid" 2>/dev/null
  if ((${#pids[@]})); then
    say "stopping ${names[*]}"
    kill -TERM "${pids[@]}" 2>/dev/null
    local deadline=$((SECONDS + 15)) i
    for i in "${!pids[@]}"; do
      while kill -0 "${pids[i]}" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
      if kill -0 "${pids[i]}" 2>/dev/null; then
        say "${names[i]} did not stop within 15s; killing it"
        kill -KILL "${pids[i]}" 2>/dev/null
      fi
      wait "${pids[i]}" 2>/dev/null
    done
  fi
  if command -v rabbitmqctl >/dev/null; then
    local q
    for q in work.push work.email work.sms dead.push dead.email dead.sms; do
      rabbitmqctl -q delete_queue "$NAMESPACE$q" >/dev/null 2>&1
    done
  fi
  if ((status == 0)); then
    rm -rf "$work"
    say "done in $((SECONDS - started_at))s"
  elif ((status == 130 || status == 141 || status == 143)); then
    say "interrupted after $((SECONDS - started_at))s; logs kept in $work" >&2
  else
    for i in "${!names[@]}"; do
      [[ -s $work/${names[i]}.log ]] || continue
      printf -- '--- last lines of %s ---\n' "$work/${names[i]}.log" >&2
      tail -n 5 "$work/${names[i]}.log" >&2
    done
    say "failed (exit $status) after $((SECONDS - started_at))s; logs kept in $work" >&2
  fi
  exit "$status"
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# Whoever reads the output went away (SIGPIPE; an EPIPE write error fails the step under
# set -e): stop everything all the same.
trap 'exit 141' PIPE

start() { # name, binary, args...
  local name=$1 binary=$2
  shift 2
  "$BIN_DIR/$binary" "$@" >"$work/$name.out" 2>"$work/$name.log" &
  pids+=($!)
  names+=("$name")
}

scripts/services.sh

BINARIES=(nudgectl nudge-producer nudge-janitor nudge-push nudge-email nudge-sms nudge-intake provider-stub)
if [[ -n $bin_dir_wanted ]]; then
  BIN_DIR=$(cd "$bin_dir_wanted" 2>/dev/null && pwd) || die "NUDGE_BIN_DIR=$bin_dir_wanted is not a directory"
else
  BIN_DIR=${CARGO_TARGET_DIR:-$ROOT/target}/debug
  for b in "${BINARIES[@]}"; do
    if [[ ! -x $BIN_DIR/$b ]]; then
      say "building the binaries (debug)"
      cargo build --workspace --bins --locked
      break
    fi
  done
fi
for b in "${BINARIES[@]}"; do
  [[ -x $BIN_DIR/$b ]] || die "$BIN_DIR/$b is missing"
done

say "fresh database $DB"
$PG -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB"

# The provider accounts are scripted as in the compose demo (deploy/compose/provider-stub.json):
# every SMS key is answered 429 with `Retry-After: 1` once, then accepted; email sits behind a
# token bucket (20/s, burst 10) that answers 429 with a Retry-After in seconds when exceeded;
# push accepts everything.
start provider-stub provider-stub --listen 127.0.0.1:0 \
  --script-file "$ROOT/deploy/compose/provider-stub.json"
deadline=$((SECONDS + 20))
until STUB_URL=$(grep -o 'http://[0-9.:]*' "$work/provider-stub.out" 2>/dev/null); do
  ((SECONDS < deadline)) || die "provider-stub did not report its address within 20s"
  kill -0 "${pids[0]}" 2>/dev/null || die "provider-stub exited"
  sleep 0.2
done
say "provider stub at $STUB_URL"

# One file for every binary; each reads only its own sections.
config=$work/nudge.toml
cat >"$config" <<EOF
[database]
url = "postgres://postgres@127.0.0.1:5432/$DB"

[amqp]
url = "amqp://guest:guest@127.0.0.1:5672/%2f"
namespace = "$NAMESPACE"

[telemetry]
log_format = "json"

[crypto]
# A fresh key for this run only.
destination_key = "$(head -c 32 /dev/urandom | base64)"
subscriber_key = "$(head -c 32 /dev/urandom | base64)"

[producer]
relay_interval_ms = 100

[janitor]
interval_ms = 500

[worker]
shutdown_grace_ms = 5000

[intake]
listen_addr = "127.0.0.1:0"

[retry]
base_delay_ms = 500
max_delay_ms = 5000

[[providers]]
account = "push-main"
channel = "push"
base_url = "$STUB_URL/accounts/push-main"
honours_idempotency = true
default_for_channel = true

[[providers]]
account = "email-main"
channel = "email"
base_url = "$STUB_URL/accounts/email-main"
honours_idempotency = true
default_for_channel = true

[[providers]]
account = "sms-main"
channel = "sms"
base_url = "$STUB_URL/accounts/sms-main"
honours_idempotency = true
default_for_channel = true
EOF
export NUDGE_CONFIG=$config

"$BIN_DIR/nudgectl" migrate
for name in producer janitor push email sms intake; do
  start "$name" "nudge-$name"
done
deadline=$((SECONDS + 20))
until INTAKE_URL=$(grep -o 'http://[0-9.:]*' "$work/intake.out" 2>/dev/null); do
  ((SECONDS < deadline)) || die "nudge-intake did not report its address within 20s"
  sleep 0.2
done
say "intake at $INTAKE_URL"

say "started: ${names[*]}"

# The demo's steps run beside a watch on the processes, so that one exiting (a bad setting, an
# unreachable service) fails the demo at once instead of at the timeout.
NUDGECTL="$BIN_DIR/nudgectl" STUB_URL=$STUB_URL INTAKE_URL=$INTAKE_URL DEMO_WORK_DIR=$work DEMO_TIMEOUT_S=120 \
  scripts/demo-run.sh &
run_pid=$!
while kill -0 "$run_pid" 2>/dev/null; do
  for i in "${!pids[@]}"; do
    kill -0 "${pids[i]}" 2>/dev/null || die "${names[i]} exited during the demo (see $work/${names[i]}.log)"
  done
  sleep 0.5
done
wait "$run_pid" || die "the demo did not complete"
run_pid=

say "deliveries in the ledger by channel and state:"
$PG -d "$DB" -c "SELECT channel, state, count(*) FROM deliveries GROUP BY 1, 2 ORDER BY 1, 2"
say "attempts by provider answer:"
$PG -d "$DB" -c "SELECT http_status, outcome_class, count(*) FROM attempts GROUP BY 1, 2 ORDER BY 1, 2"
