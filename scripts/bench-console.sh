#!/usr/bin/env bash
# The console's page-time benchmark (issue 29: every page under 200 ms of server time with
# 1,000,000 deliveries in the ledger, never a scan of settled history). Builds the release
# nudge-console and nudgectl, makes a ledger of --deliveries deliveries (bench/console/seed.sql:
# mostly settled history over --days days, 1% dead-lettered, 1.5% owed, --tenants tenants),
# starts nudge-console on it as the nudge_console role, logs in with an operator's token and
# asks each page --requests times (after 3 unmeasured), the redrive's dry run included. For each
# page: the server's own time (nudge_console_page_seconds, the mean over the measured requests),
# and the time the client saw on loopback (median, p95, max). Then the scans the pages made of
# `deliveries`, from pg_stat_user_tables: a sequential scan there is a scan of settled history.
# Writes bench/results/console-pages-<UTC stamp>.md and console-pages-latest.md (or under
# --results DIR). Stops the console and drops its database at the end, on failure too.
#   scripts/bench-console.sh [--deliveries N] [--tenants N] [--days N] [--requests N]
#                            [--results DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
deliveries=1000000 tenants=200 days=30 requests=20 results=bench/results
while (($#)); do
  case $1 in
    --deliveries) deliveries=$2; shift 2 ;;
    --tenants) tenants=$2; shift 2 ;;
    --days) days=$2; shift 2 ;;
    --requests) requests=$2; shift 2 ;;
    --results) results=$2; shift 2 ;;
    -h | --help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-console.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
done
for n in "$deliveries" "$tenants" "$days" "$requests"; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || { echo "bench-console.sh: $n is not a positive whole number" >&2; exit 2; }
done
((requests <= 1000 && deliveries <= 20000000)) || { echo "bench-console.sh: at most 1000 requests a page and 20,000,000 deliveries" >&2; exit 2; }
say() { printf 'bench-console: %s\n' "$*" >&2; }

scripts/services.sh
cargo build --release --locked --bin nudge-console --bin nudgectl
for tool in psql curl jq python3; do command -v "$tool" >/dev/null || { say "$tool is needed"; exit 1; }; done

db=nudge_bench_console
admin_url=postgres://postgres@127.0.0.1:5432
work=$(mktemp -d -t nudge-bench-console.XXXXXX)
console_pid=
cleanup() {
  local status=$?
  if [[ -n $console_pid ]]; then
    kill -TERM "$console_pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$console_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$console_pid" 2>/dev/null || true
  fi
  psql "$admin_url/postgres" -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true
  if ((status == 0)); then rm -rf "$work"; else say "work directory kept: $work"; fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
export PGOPTIONS=--client-min-messages=warning

psql "$admin_url/postgres" -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db"
NUDGE_DATABASE__URL=$admin_url/$db target/release/nudgectl migrate >/dev/null
say "seeding $deliveries deliveries of $tenants tenants over $days days"
started=$SECONDS
psql "$admin_url/$db" -q -v tenants="$tenants" -v deliveries="$deliveries" -v days="$days" \
  -v audit=20000 -f bench/console/seed.sql
say "seeded in $((SECONDS - started)) s"

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
admin_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat >"$work/console.toml" <<TOML
[database]
url = "postgres://nudge_console@127.0.0.1:5432/$db"

[telemetry]
log_format = "json"
metrics_addr = "127.0.0.1:$admin_port"

[console]
listen_addr = "127.0.0.1:$port"
secure_cookies = false
session_key = "$(head -c 48 /dev/urandom | base64 -w0)"
TOML
while read -r var; do unset "$var"; done < <(compgen -e | grep '^NUDGE_' || true)
target/release/nudge-console --config "$work/console.toml" >"$work/console.log" 2>&1 &
console_pid=$!
base=http://127.0.0.1:$port
for _ in $(seq 1 100); do
  curl -fsS -o /dev/null "$base/login" 2>/dev/null && break
  kill -0 "$console_pid" 2>/dev/null || { say "nudge-console exited: $(tail -n 3 "$work/console.log")"; exit 1; }
  sleep 0.1
done
token=$(NUDGE_DATABASE__URL=$admin_url/$db NUDGE_ACTOR=bench target/release/nudgectl console token create \
  --name bench --role operator --expires-in 1h --reason "console benchmark" 2>/dev/null)
jar=$work/cookies
[[ $(curl -sS -o /dev/null -w '%{http_code}' -c "$jar" --data-urlencode "token=$token" "$base/login") == 303 ]] ||
  { say "login failed"; exit 1; }
csrf=$(curl -fsS -b "$jar" "$base/redrives" | grep -o 'name="csrf" value="[^"]*"' | head -n 1 | sed 's/.*value="//; s/"$//')
dead=$(psql "$admin_url/$db" -Atc "SELECT id FROM deliveries WHERE state = 'dead_lettered' LIMIT 1")
tenant=$(psql "$admin_url/$db" -Atc "SELECT name FROM tenants ORDER BY name LIMIT 1")

# page label, histogram label, method, path
pages=(
  "overview|overview|GET|/"
  "tenants|tenants|GET|/tenants"
  "dead letters|dead_letters|GET|/dead-letters"
  "dead letters, sms|dead_letters|GET|/dead-letters?channel=sms"
  "redrives|redrives|GET|/redrives"
  "redrive dry run, sms|redrive_plan|POST|/redrives/plan"
  "trace, a delivery|trace|GET|/trace?id=$dead"
  "trace, tenant/event|trace|GET|/trace?id=$tenant/bench-0"
  "audit log|audit|GET|/audit"
  "audit, one actor|audit|GET|/audit?actor=console%3Aalice"
  "audit, one incident|audit|GET|/audit?incident=INC-5"
)
ask() { # method path -> time_total
  if [[ $1 == POST ]]; then
    curl -sS -o /dev/null -w '%{http_code} %{time_total}\n' -b "$jar" \
      --data "csrf=$csrf&channel=sms&rate=5&tenant=&max_age_h=&limit=" "$base$2"
  else
    curl -sS -o /dev/null -w '%{http_code} %{time_total}\n' -b "$jar" "$base$2"
  fi
}
scrape() { curl -fsS "http://127.0.0.1:$admin_port/metrics"; }
scans() {
  psql "$admin_url/$db" -Atc "SELECT relname, seq_scan, COALESCE(idx_scan, 0) FROM pg_stat_user_tables
    WHERE relname IN ('deliveries', 'reminders', 'audit_log') ORDER BY relname"
}
# Statistics reach pg_stat_user_tables within PostgreSQL's idle flush (10 s in PostgreSQL 15).
sleep 11
scans >"$work/scans-before"
: >"$work/times"
for entry in "${pages[@]}"; do
  IFS='|' read -r label metric method path <<<"$entry"
  for _ in 1 2 3; do ask "$method" "$path" >/dev/null; done
  before=$(scrape | awk -v m="$metric" '$1 == "nudge_console_page_seconds_sum{page=\"" m "\"}" {s=$2} $1 == "nudge_console_page_seconds_count{page=\"" m "\"}" {c=$2} END {print s+0, c+0}')
  for _ in $(seq 1 "$requests"); do
    read -r code t < <(ask "$method" "$path")
    [[ $code == 200 ]] || { say "$label: $path answered $code"; exit 1; }
    printf '%s\t%s\n' "$label" "$t" >>"$work/times"
  done
  after=$(scrape | awk -v m="$metric" '$1 == "nudge_console_page_seconds_sum{page=\"" m "\"}" {s=$2} $1 == "nudge_console_page_seconds_count{page=\"" m "\"}" {c=$2} END {print s+0, c+0}')
  printf '%s\t%s\t%s\n' "$label" "$before" "$after" >>"$work/server"
done
sleep 11
scans >"$work/scans-after"

stamp=$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$results"
out=$results/console-pages-$stamp.md
DELIVERIES=$deliveries TENANTS=$tenants DAYS=$days REQUESTS=$requests STAMP=$stamp \
  python3 - "$work/times" "$work/server" "$work/scans-before" "$work/scans-after" >"$out" <<'PY'
import os, statistics, sys
times, server, before, after = sys.argv[1:5]
by = {}
order = []
for line in open(times):
    label, t = line.rstrip("\n").split("\t")
    if label not in by:
        by[label] = []
        order.append(label)
    by[label].append(float(t) * 1000)
srv = {}
for line in open(server):
    label, b, a = line.rstrip("\n").split("\t")
    bs, bc = map(float, b.split())
    as_, ac = map(float, a.split())
    srv[label] = (as_ - bs) / (ac - bc) * 1000 if ac > bc else float("nan")
def scans(path):
    out = {}
    for line in open(path):
        rel, seq, idx = line.strip().split("|")
        out[rel] = (int(seq), int(idx))
    return out
b, a = scans(before), scans(after)
e = os.environ
print(f"# Console page times, {e['STAMP']}\n")
print(f"`scripts/bench-console.sh --deliveries {e['DELIVERIES']} --tenants {e['TENANTS']} --days {e['DAYS']} --requests {e['REQUESTS']}`: "
      f"release build, one nudge-console as the `nudge_console` role over a ledger of {int(e['DELIVERIES']):,} deliveries "
      "(bench/console/seed.sql: 96.5% delivered history, 1% dead-lettered, 1.5% owed), on this machine (2 cores, shared). "
      "Server: nudge_console_page_seconds, mean of the measured requests (queries and rendering). "
      "Client: the time curl saw on loopback. Target (issue 29): under 200 ms of server time.\n")
print("| page | server mean ms | client median ms | client p95 ms | client max ms | under 200 ms |")
print("|---|---:|---:|---:|---:|---|")
worst = 0.0
for label in order:
    ts = sorted(by[label])
    p95 = ts[min(len(ts) - 1, int(round(0.95 * (len(ts) - 1))))]
    s = srv.get(label, float("nan"))
    worst = max(worst, s)
    print(f"| {label} | {s:.1f} | {statistics.median(ts):.1f} | {p95:.1f} | {ts[-1]:.1f} | {'yes' if s < 200 else 'NO'} |")
print()
print("Scans during the measured requests (pg_stat_user_tables, after minus before):\n")
print("| table | sequential scans | index scans |")
print("|---|---:|---:|")
for rel in sorted(a):
    print(f"| {rel} | {a[rel][0] - b[rel][0]} | {a[rel][1] - b[rel][1]} |")
print()
seq = a["deliveries"][0] - b["deliveries"][0]
print(f"Worst page, server mean: {worst:.1f} ms; sequential scans of deliveries: {seq}.")
PY
cp "$out" "$results/console-pages-latest.md"
cat "$out"
