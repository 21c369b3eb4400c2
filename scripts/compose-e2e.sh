#!/usr/bin/env bash
# The compose stack end to end, on a machine without a container registry: builds the images
# as deploy/README.md describes ("Without a registry": the binaries built on the host, a Debian
# base image made with debootstrap), starts docker-compose.yml with the SMS worker scaled to two,
# runs the demo (420 deliveries), SIGKILLs one of the two SMS workers while it holds leases on
# SMS deliveries (the stub takes 2 s to accept an SMS here, and the SMS workers' leases last
# 15 s, so that the janitor reaps the dead worker's leases within the run: a compose override
# in the work directory), and checks, from the provider stub's record of every idempotency key
# (GET /stats/keys), that
# every delivery of the demo was accepted exactly once: one accepting answer per key (repeats of
# an accepted key are answered from the stub's dedup and counted, not accepted again), as many
# keys as deliveries. Also checks that no other service restarted (RabbitMQ's health check
# waits for AMQP, so the producer does not start too early).
#
# The Docker engine: used when `docker info` answers; otherwise, as root, Debian's docker.io,
# docker-compose and debootstrap are installed when missing and dockerd is started in the
# background (log in the work directory) and stopped at the end.
#
# Exit status: 0 passed; 1 failed; 3 cannot run here (no Docker engine can be started: the
# reason is printed), which .ci/run reports as such rather than as a pass.
#
# Environment: NUDGE_BIN_DIR (default target/debug, built with cargo when it lacks a binary),
# BASE_IMAGE (default local/debian:bookworm, made with debootstrap when missing),
# COMPOSE_E2E_KEEP=1 (leave the stack running for a look; `docker-compose -p nudge-e2e down -v`).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
while read -r var; do
  case $var in NUDGE_BIN_DIR) ;; *) unset "$var" ;; esac
done < <(compgen -e | grep '^NUDGE_' || true)

CANNOT_RUN=3
PROJECT=nudge-e2e
EXPECTED=420 # the demo: 300 reminders, 420 deliveries (scripts/demo-run.sh)
say() { printf 'compose-e2e.sh: %s\n' "$*"; }
fail() { printf 'compose-e2e.sh: FAILED: %s\n' "$*" >&2; exit 1; }
cannot_run() {
  printf 'compose-e2e.sh: CANNOT RUN HERE: %s\n' "$*" >&2
  exit "$CANNOT_RUN"
}

work=$(mktemp -d -t nudge-compose-e2e.XXXXXX)
dockerd_pid=
stack_up=
compose() { docker-compose -p "$PROJECT" "$@"; }
cleanup() {
  local status=$?
  set +e
  if [[ -n $stack_up && ${COMPOSE_E2E_KEEP:-} != 1 ]]; then
    if ((status != 0 && status != CANNOT_RUN)); then
      compose logs --no-color >"$work/compose.log" 2>&1
      say "the stack's logs: $work/compose.log"
    fi
    compose down -v --remove-orphans >/dev/null 2>&1
  fi
  if [[ -n $dockerd_pid ]]; then
    kill -TERM "$dockerd_pid" 2>/dev/null
    local deadline=$((SECONDS + 30))
    while kill -0 "$dockerd_pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
    kill -KILL "$dockerd_pid" 2>/dev/null
    say "stopped the dockerd this script started"
  fi
  if ((status == 0)); then rm -rf "$work"; else say "work directory kept: $work"; fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---- a Docker engine ----------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
  missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v docker-compose >/dev/null || missing+=(docker-compose)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  if ((${#missing[@]})); then
    [[ $(id -u) -eq 0 ]] || cannot_run "no Docker engine answers and ${missing[*]} cannot be installed without root"
    say "installing ${missing[*]} from Debian's packages"
    if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } >"$work/apt.log" 2>&1; then
      cannot_run "installing ${missing[*]} failed: $(tail -n 3 "$work/apt.log" | tr '\n' ' ')"
    fi
  fi
  [[ $(id -u) -eq 0 ]] || cannot_run "no Docker engine answers and dockerd needs root to start"
  say "starting dockerd (log: $work/dockerd.log)"
  dockerd >"$work/dockerd.log" 2>&1 &
  dockerd_pid=$!
  deadline=$((SECONDS + 60))
  until docker info >/dev/null 2>&1; do
    if ! kill -0 "$dockerd_pid" 2>/dev/null; then
      dockerd_pid=
      cannot_run "dockerd exited: $(grep -iE 'level=(fatal|error)|failed' "$work/dockerd.log" | tail -n 3 | tr '\n' ' ')"
    fi
    ((SECONDS < deadline)) || cannot_run "dockerd did not answer within 60 s: $(tail -n 3 "$work/dockerd.log" | tr '\n' ' ')"
    sleep 1
  done
fi
command -v docker-compose >/dev/null || cannot_run "docker-compose is missing (apt-get install docker-compose)"
say "Docker engine $(docker version --format '{{.Server.Version}}'), $(docker-compose version --short)"
# A container must start: the engine may run without the privileges containers need.
base=${BASE_IMAGE:-local/debian:bookworm}
if ! docker image inspect "$base" >/dev/null 2>&1; then
  [[ $base == local/debian:bookworm ]] || fail "BASE_IMAGE $base is not a local image"
  command -v debootstrap >/dev/null || cannot_run "debootstrap is missing (apt-get install debootstrap)"
  say "making $base with debootstrap (about a minute)"
  debootstrap --variant=minbase bookworm "$work/rootfs" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 ||
    fail "debootstrap failed: $(tail -n 3 "$work/debootstrap.log" | tr '\n' ' ')"
  tar -C "$work/rootfs" -c . | docker import - "$base" >/dev/null
  rm -rf "$work/rootfs"
fi
if ! out=$(timeout 60 docker run --rm "$base" true 2>&1); then
  cannot_run "the engine cannot start a container: $out"
fi

# ---- images and the stack -----------------------------------------------------------------
bin_dir=${NUDGE_BIN_DIR:-target/debug}
for bin in nudgectl nudge-producer nudge-janitor nudge-events nudge-push nudge-email nudge-sms nudge-intake provider-stub; do
  if [[ ! -x $bin_dir/$bin ]]; then
    [[ $bin_dir == target/debug ]] || fail "$bin_dir/$bin is missing"
    say "building the binaries (cargo build --workspace --bins)"
    cargo build --locked -q --workspace --bins
    break
  fi
done
# Host ports of their own, so that the stack runs beside the services of scripts/services.sh
# and anything on the compose defaults.
export NUDGE_DOCKERFILE=deploy/docker/Dockerfile.prebuilt NUDGE_BIN_DIR=$bin_dir BASE_IMAGE=$base \
  NUDGE_POSTGRES_PORT=35433 NUDGE_RABBITMQ_PORT=35673 NUDGE_RABBITMQ_UI_PORT=35674 \
  NUDGE_STUB_PORT=38080 NUDGE_INTAKE_PORT=38090
STUB=http://127.0.0.1:$NUDGE_STUB_PORT
# The demo's stub accounts, but an SMS takes 2 s to accept: a killed worker then dies holding
# sends in progress. Leases of 15 s (at least the provider timeout of 10 s + admission's 1.5 s
# + 1 s) let the janitor reap them within the run.
jq '."sms-main".default.delay_ms = 2000' deploy/compose/provider-stub.json >"$work/provider-stub.json"
cat >"$work/override.yml" <<YAML
services:
  provider-stub:
    command: [provider-stub, --listen, "0.0.0.0:8080", --allow-non-loopback,
              --script-file, /etc/nudge-e2e/provider-stub.json]
    volumes:
      - $work/provider-stub.json:/etc/nudge-e2e/provider-stub.json:ro
  sms:
    environment:
      NUDGE_WORKER__LEASE_SECONDS: "15"
YAML
compose() { docker-compose -p "$PROJECT" -f docker-compose.yml -f "$work/override.yml" "$@"; }
compose down -v --remove-orphans >/dev/null 2>&1 || true
say "building the images"
compose build >"$work/build.log" 2>&1 || fail "docker-compose build: $(tail -n 5 "$work/build.log" | tr '\n' ' ')"
stack_up=1
say "starting the stack with two SMS workers"
started=$SECONDS
compose up -d --scale sms=2 postgres rabbitmq migrate provider-stub intake producer janitor events push email sms \
  >"$work/up.log" 2>&1 || fail "docker-compose up: $(tail -n 5 "$work/up.log" | tr '\n' ' ')"
say "stack up in $((SECONDS - started)) s"
mapfile -t sms < <(compose ps -q sms)
((${#sms[@]} == 2)) || fail "expected two sms containers, found ${#sms[@]}"

# ---- the demo, with one SMS worker killed while it holds leases ---------------------------
# Each worker logs its worker_id at start; the ledger's lease_owner says who holds what.
declare -A owner_of
for c in "${sms[@]}"; do
  deadline=$((SECONDS + 60))
  until id=$(docker logs "$c" 2>&1 | grep -o 'sms-[0-9]*-[0-9a-f]\{8\}' | head -n 1) && [[ -n $id ]]; do
    ((SECONDS < deadline)) || fail "sms container ${c:0:12} did not log its worker_id"
    sleep 0.5
  done
  owner_of[$id]=$c
done
held() { # lease_owner count, the owner holding the most SMS leases
  PGOPTIONS=--client-min-messages=warning psql -h 127.0.0.1 -p "$NUDGE_POSTGRES_PORT" -U postgres -d nudge -AtF ' ' -c \
    "SELECT lease_owner, count(*) FROM deliveries WHERE channel = 'sms' AND state = 'sending'
     GROUP BY 1 ORDER BY 2 DESC LIMIT 1" 2>/dev/null
}
say "running the demo"
compose run --rm demo >"$work/demo.log" 2>&1 &
demo_pid=$!
deadline=$((SECONDS + 120))
victim= victim_leases=0
while [[ -z $victim ]]; do
  kill -0 "$demo_pid" 2>/dev/null || fail "the demo ended before an SMS worker held 5 leases (demo log: $work/demo.log)"
  ((SECONDS < deadline)) || fail "no SMS worker held 5 leases within 120 s (demo log: $work/demo.log)"
  read -r id count < <(held) || true
  if [[ -n ${id:-} && ${count:-0} -ge 5 && -n ${owner_of[$id]:-} ]]; then
    victim=${owner_of[$id]} victim_leases=$count
  else
    sleep 0.2
  fi
done
say "SIGKILL of sms container ${victim:0:12} while it holds $victim_leases SMS leases"
docker kill -s KILL "$victim" >/dev/null
demo_status=0
wait "$demo_pid" || demo_status=$?
sed 's/^/  | /' "$work/demo.log" | tail -n 20
((demo_status == 0)) || fail "the demo exited $demo_status"

# ---- exactly once -------------------------------------------------------------------------
curl -fsS "$STUB/stats/keys" >"$work/keys.json" || fail "the stub's /stats/keys did not answer"
read -r keys accepted_once over_once duplicates < <(jq -r '
  [.keys[] | [.requests[] | select(.kind == "scripted" and .status >= 200 and .status < 300)] | length] as $n
  | [ ($n | length),
      ($n | map(select(. == 1)) | length),
      ($n | map(select(. > 1)) | length),
      ([.keys[].requests[] | select(.kind == "duplicate")] | length) ] | @tsv' "$work/keys.json")
say "provider stub: $keys keys, $accepted_once accepted once, $over_once accepted more than once, $duplicates repeats answered from its dedup"
((over_once == 0)) || fail "$over_once deliveries were accepted more than once"
((keys == EXPECTED && accepted_once == EXPECTED)) ||
  fail "expected $EXPECTED deliveries accepted once each, got $accepted_once of $keys keys"
restarts=$(for c in $(compose ps -q producer janitor events push email intake provider-stub); do
  docker inspect -f '{{.Name}} {{.RestartCount}}' "$c"; done | awk '$2 > 0' | tr '\n' ' ')
[[ -z $restarts ]] || fail "services restarted: $restarts"
reaped=$(PGOPTIONS=--client-min-messages=warning psql -h 127.0.0.1 -p "$NUDGE_POSTGRES_PORT" -U postgres -d nudge -Atc \
  "SELECT count(*) FROM attempts WHERE worker = 'lease-reaper'" 2>/dev/null || echo '?')
say "passed: $EXPECTED deliveries accepted exactly once with one of two SMS workers killed holding $victim_leases leases ($duplicates repeats answered from the stub's dedup, $reaped sends the lease reaper decided); no other service restarted"
