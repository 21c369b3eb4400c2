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
# And that the delivery events flow: before the demo, its tenant's webhook is set (nudgectl
# tenant webhook set) to the receiver the stub serves on the compose network
# (http://provider-stub:8080/webhooks/demo-events), and nudge-events is let through to it
# (events.allow_http, and events.allow_addresses naming the compose network's range, read from
# the network once it exists: the events service starts after the others). After the demo,
# once the receiver acknowledged every event of the tenant the ledger numbered (bounded), what
# it kept (GET /stats/webhooks/demo-events) must hold: every request's signature verified with
# the `standardwebhooks` package from PyPI, as a client verifies it (independent of the Rust
# crate that signs; its virtualenv is the tests', NUDGE_TEST_CLIENTS_VENV, installed by
# scripts/clients.sh when missing); exactly the ledger's events of the tenant, deduplicated by
# event id (delivery is at least once, a repeat must be the same event); their positions
# increasing per tenant in arrival order; and a `sent` event for each of the demo's deliveries,
# exactly the ledger's delivered ones.
#
# And that the console serves: a viewer's token made with nudgectl logs in over the console's
# published port, and the overview and the tenants page show the SMS channel and the demo's tenant.
#
# The Docker engine: used when `docker info` answers; otherwise, as root, Debian's docker.io,
# docker-compose and debootstrap are installed when missing and dockerd is started in the
# background (log in the work directory) and stopped at the end.
#
# Exit status: 0 passed; 1 failed; 3 cannot run here (no Docker engine can be started, or the
# `standardwebhooks` package cannot be installed: the reason is printed), which .ci/run reports
# as such rather than as a pass.
#
# Environment: NUDGE_BIN_DIR (default target/debug, built with cargo when it lacks a binary),
# BASE_IMAGE (default local/debian:bookworm, made with debootstrap when missing),
# NUDGE_TEST_CLIENTS_VENV (the virtualenv with `standardwebhooks`, default
# ~/.cache/nudge/clients-venv), COMPOSE_E2E_KEEP=1 (leave the stack running for a look;
# `docker-compose -p nudge-e2e down -v`).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
while read -r var; do
  case $var in NUDGE_BIN_DIR | NUDGE_TEST_CLIENTS_VENV) ;; *) unset "$var" ;; esac
done < <(compgen -e | grep '^NUDGE_' || true)

CANNOT_RUN=3
PROJECT=nudge-e2e
EXPECTED=420 # the demo: 300 reminders, 420 deliveries (scripts/demo-run.sh)
TENANT=compose-e2e-clinic # the demo's tenant, made before it to set its webhook
WEBHOOK=demo-events       # the receiver's name: POST /webhooks/demo-events on the stub
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

# ---- the verifier of the events' signatures ------------------------------------------------
venv=${NUDGE_TEST_CLIENTS_VENV:-$HOME/.cache/nudge/clients-venv}
if ! "$venv/bin/python" -c 'import standardwebhooks' 2>/dev/null; then
  say "installing the standardwebhooks package into $venv (scripts/clients.sh)"
  # clients.sh also installs the Node client's packages: only the Python one is needed here.
  scripts/clients.sh >"$work/clients.log" 2>&1 || true
  "$venv/bin/python" -c 'import standardwebhooks' 2>/dev/null ||
    cannot_run "the standardwebhooks package could not be installed: $(tail -n 3 "$work/clients.log" | tr '\n' ' ')"
fi

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
for bin in nudgectl nudge-producer nudge-janitor nudge-events nudge-console nudge-push nudge-email nudge-sms nudge-intake provider-stub; do
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
  NUDGE_STUB_PORT=38080 NUDGE_INTAKE_PORT=38090 NUDGE_CONSOLE_PORT=38095
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
: >"$work/events.yml" # the events service's override, written once the network exists
compose() {
  local files=(-f docker-compose.yml -f "$work/override.yml")
  [[ -s $work/events.yml ]] && files+=(-f "$work/events.yml")
  docker-compose -p "$PROJECT" "${files[@]}" "$@"
}
compose down -v --remove-orphans >/dev/null 2>&1 || true
say "building the images"
compose build >"$work/build.log" 2>&1 || fail "docker-compose build: $(tail -n 5 "$work/build.log" | tr '\n' ' ')"
stack_up=1
say "starting the stack with two SMS workers"
started=$SECONDS
compose up -d --scale sms=2 postgres rabbitmq migrate provider-stub intake producer janitor console push email sms \
  >"$work/up.log" 2>&1 || fail "docker-compose up: $(tail -n 5 "$work/up.log" | tr '\n' ' ')"
# nudge-events pushes to the stub on the compose network: over plain http, to an address in a
# private range its guard refuses unless events.allow_addresses names it. The range is the
# network's own, known once compose made it.
mapfile -t subnets < <(docker network inspect -f '{{range .IPAM.Config}}{{println .Subnet}}{{end}}' \
  "${PROJECT}_default" 2>/dev/null | grep .)
((${#subnets[@]})) || fail "no subnet found for the network ${PROJECT}_default"
cat >"$work/events.yml" <<YAML
services:
  events:
    environment:
      NUDGE_EVENTS__ALLOW_HTTP: "true"
      NUDGE_EVENTS__ALLOW_ADDRESSES: '$(jq -cn '$ARGS.positional' --args "${subnets[@]}")'
YAML
compose up -d --no-deps events >>"$work/up.log" 2>&1 ||
  fail "docker-compose up events: $(tail -n 5 "$work/up.log" | tr '\n' ' ')"
say "stack up in $((SECONDS - started)) s; nudge-events may reach ${subnets[*]}"
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
# The demo's tenant, made first so that its webhook is set before its first event. `tenant
# create` of an existing name only shows it, so the demo takes it as its own (DEMO_TENANT).
ctl() { compose run --rm -T --no-deps demo nudgectl "$@"; }
ctl tenant create "$TENANT" >"$work/tenant.log" 2>&1 ||
  fail "nudgectl tenant create: $(tail -n 3 "$work/tenant.log" | tr '\n' ' ')"
secret=$(ctl tenant webhook set "$TENANT" --url "http://provider-stub:8080/webhooks/$WEBHOOK" --allow-http \
  --reason "compose-e2e: the demo tenant's events to the receiver on the compose network" 2>"$work/webhook.log" |
  grep -o 'whsec_[A-Za-z0-9+/=]*' | head -n 1) || true
[[ -n $secret ]] || fail "nudgectl tenant webhook set printed no secret: $(tail -n 3 "$work/webhook.log" | tr '\n' ' ')"
say "tenant $TENANT: its events pushed to http://provider-stub:8080/webhooks/$WEBHOOK"
say "running the demo"
compose run --rm -e DEMO_TENANT="$TENANT" demo >"$work/demo.log" 2>&1 &
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
restarts=$(for c in $(compose ps -q producer janitor events console push email intake provider-stub); do
  docker inspect -f '{{.Name}} {{.RestartCount}}' "$c"; done | awk '$2 > 0' | tr '\n' ' ')
[[ -z $restarts ]] || fail "services restarted: $restarts"
reaped=$(PGOPTIONS=--client-min-messages=warning psql -h 127.0.0.1 -p "$NUDGE_POSTGRES_PORT" -U postgres -d nudge -Atc \
  "SELECT count(*) FROM attempts WHERE worker = 'lease-reaper'" 2>/dev/null || echo '?')

# ---- the delivery events, pushed to the receiver ------------------------------------------
sql() { PGOPTIONS=--client-min-messages=warning psql -h 127.0.0.1 -p "$NUDGE_POSTGRES_PORT" -U postgres -d nudge \
  -v ON_ERROR_STOP=1 -AtF ' ' -c "$1" 2>>"$work/psql.log"; }
tenant_id=$(sql "SELECT id FROM tenants WHERE name = '$TENANT'") && [[ -n $tenant_id ]] ||
  fail "tenant $TENANT is not in the ledger"
# Every event is numbered by the janitor after its commit, then pushed: done once none waits
# for a number and the receiver acknowledged the newest.
pushed() {
  sql "SELECT (SELECT count(*) FROM delivery_events WHERE tenant_id = '$tenant_id' AND position IS NULL),
              (SELECT coalesce(max(position), 0) FROM delivery_events WHERE tenant_id = '$tenant_id'),
              w.acked_position, w.enabled, w.failures
       FROM tenant_webhooks w WHERE w.tenant_id = '$tenant_id'"
}
deadline=$((SECONDS + 60))
while true; do
  read -r unnumbered newest acked enabled failures < <(pushed) || true
  ((${unnumbered:-1} == 0 && ${newest:-0} > 0 && ${acked:-0} == newest)) && break
  if ((SECONDS >= deadline)); then
    fail "within 60 s the receiver acknowledged events through position ${acked:-?} of ${newest:-?} (${unnumbered:-?} not numbered yet; webhook enabled: ${enabled:-?}, failures: ${failures:-?}, last error: $(sql "SELECT last_error FROM tenant_webhooks WHERE tenant_id = '$tenant_id'"))"
  fi
  sleep 0.5
done
curl -fsS "$STUB/stats/webhooks/$WEBHOOK" >"$work/webhook.json" || fail "the stub's /stats/webhooks/$WEBHOOK did not answer"
sql "SELECT event_uuid FROM delivery_events WHERE tenant_id = '$tenant_id' AND position IS NOT NULL" \
  >"$work/ledger-events.txt" || fail "reading the tenant's events from the ledger failed"
sql "SELECT id FROM deliveries WHERE tenant_id = '$tenant_id' AND state = 'delivered'" \
  >"$work/ledger-delivered.txt" || fail "reading the tenant's deliveries from the ledger failed"
# As a client reads them: each request verified (signature and timestamp, within the package's
# 5 minutes) before its body is used, each event taken once by its id. Prints the figures in
# one line, and what is wrong on stderr.
cat >"$work/events-check.py" <<'PY'
import json
import os
import sys

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

record, ledger_events, ledger_delivered = sys.argv[1:4]
webhook = Webhook(os.environ["WEBHOOK_SECRET"])
with open(record) as f:
    requests = json.load(f)["requests"]
with open(ledger_events) as f:
    in_ledger = set(f.read().split())
with open(ledger_delivered) as f:
    delivered = set(f.read().split())

refused = received = changed = disordered = 0
first = {}  # event id -> the event as first received
last_position = {}  # tenant id -> position of its last new event
sent = set()  # delivery ids with a `sent` event
for request in requests:
    body = request["body"].encode()
    try:
        webhook.verify(body, request["headers"])
    except WebhookVerificationError as why:
        refused += 1
        print(f"refused {request['headers'].get('webhook-id')}: {why}", file=sys.stderr)
        continue
    batch = json.loads(body)
    tenant = batch["data"]["tenant_id"]
    for event in batch["data"]["events"]:
        received += 1
        seen = first.get(event["id"])
        if seen is not None:
            if seen != event:
                changed += 1
                print(f"event {event['id']} came again changed", file=sys.stderr)
            continue
        first[event["id"]] = event
        if event["position"] <= last_position.get(tenant, 0):
            disordered += 1
            print(f"position {event['position']} after {last_position[tenant]}", file=sys.stderr)
        last_position[tenant] = event["position"]
        if event["kind"] == "sent":
            sent.add(event["delivery_id"])

ids = set(first)
print(len(requests), refused, len(ids), received - len(ids), changed, disordered,
      len(in_ledger), len(in_ledger - ids), len(ids - in_ledger), len(sent), len(delivered),
      len(delivered - sent), sep="\t")
PY
read -r requests refused distinct repeats changed disordered ledger_events missing unknown sent \
  delivered unsent < <(WEBHOOK_SECRET=$secret "$venv/bin/python" "$work/events-check.py" "$work/webhook.json" \
  "$work/ledger-events.txt" "$work/ledger-delivered.txt" 2>"$work/events-check.log") || true
[[ -n ${unsent:-} ]] || fail "the events check did not run: $(tail -n 3 "$work/events-check.log" | tr '\n' ' ')"
say "events: $requests batches at the receiver, $refused refused by standardwebhooks; $distinct events of the ledger's $ledger_events ($missing missing, $unknown unknown, $repeats repeats, $changed changed), $disordered out of position order; a sent event for $sent deliveries of the ledger's $delivered delivered ($unsent without)"
((requests > 0 && refused == 0)) || fail "$refused of $requests batches failed verification: $(head -n 3 "$work/events-check.log" | tr '\n' ' ')"
((missing == 0 && unknown == 0 && changed == 0)) ||
  fail "the receiver's events are not the ledger's: $missing missing, $unknown not in the ledger, $changed changed on a repeat"
((disordered == 0)) || fail "$disordered events arrived out of position order: $(head -n 3 "$work/events-check.log" | tr '\n' ' ')"
((delivered == EXPECTED && sent == EXPECTED && unsent == 0)) ||
  fail "expected a sent event for each of the $EXPECTED deliveries: $sent sent events, $delivered delivered in the ledger, $unsent of them without one"
# ---- the console --------------------------------------------------------------------------
# A viewer's token made with nudgectl, a login over the published port, and the pages that
# answer "how late, for whom": the demo's tenant and the SMS channel are on them.
console_url=http://127.0.0.1:$NUDGE_CONSOLE_PORT
console_token=$(ctl console token create --name compose-e2e --role viewer --expires-in 10m \
  --reason "compose-e2e: read the console" 2>"$work/console-token.log" | grep -o 'nct_[A-Za-z0-9_-]*' | head -n 1) || true
[[ -n $console_token ]] || fail "nudgectl console token create printed no token: $(tail -n 3 "$work/console-token.log" | tr '\n' ' ')"
jar=$work/console-cookies
login_status=$(curl -sS -o /dev/null -w '%{http_code}' -c "$jar" --data-urlencode "token=$console_token" "$console_url/login") ||
  fail "the console at $console_url did not answer"
[[ $login_status == 303 ]] || fail "the console's login answered $login_status, not 303"
curl -fsS -b "$jar" "$console_url/tenants" >"$work/console-tenants.html" || fail "the console's /tenants did not answer 200"
grep -qF "$TENANT" "$work/console-tenants.html" || fail "the console's /tenants does not show $TENANT"
curl -fsS -b "$jar" "$console_url/" >"$work/console-overview.html" || fail "the console's overview did not answer 200"
grep -qF '<th scope="row">sms</th>' "$work/console-overview.html" || fail "the console's overview shows no sms row"
say "console: a viewer logged in over $console_url and read the overview and the tenants ($TENANT among them)"
say "passed: $EXPECTED deliveries accepted exactly once with one of two SMS workers killed holding $victim_leases leases ($duplicates repeats answered from the stub's dedup, $reaped sends the lease reaper decided), each with its sent event pushed signed and in order to the tenant's webhook ($distinct events in $requests batches); the console read; no other service restarted"
