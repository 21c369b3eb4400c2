#!/usr/bin/env bash
# Schemathesis against a live nudge-intake: the committed contract (docs/openapi.json, which a
# test keeps equal to what the code generates) drives generated requests, each signed by
# scripts/schemathesis_hooks.py, and every answer is checked against the contract. It fails
# on any server error or any answer the contract does not allow.
#
# It installs Schemathesis from PyPI into a virtualenv when missing (SCHEMATHESIS_VENV, default
# ~/.cache/nudge/schemathesis-venv), builds nudge-intake and nudgectl (debug) unless
# NUDGE_BIN_DIR names built ones, makes a fresh database with one tenant and its signing
# secret, starts the intake on loopback, runs, and always stops the intake and drops the
# database. Needs PostgreSQL on 127.0.0.1 (scripts/services.sh), psql and python3 with venv.
#
# Checks: no server error, and every status code, content type, header and body as the
# contract says. Not run: the checks of what a request must be refused for (ignored_auth,
# missing_required_header: the hook signs every request, including the ones meant to go
# unsigned; the refusals are tested in crates/intake/tests/it/api.rs), and of which generated
# bodies are accepted (negative_data_rejection, positive_data_acceptance: the contract cannot
# express every rule, e.g. a destination per listed channel or the schedule-ahead limit, and
# a batch answers 200 with a 400 per bad item by design).
#
# Environment: SCHEMATHESIS_MAX_EXAMPLES (default 250 per operation and phase),
# SCHEMATHESIS_SEED (default 1).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
bin_dir_wanted=${NUDGE_BIN_DIR:-}
while read -r var; do unset "$var"; done < <(compgen -e | grep '^NUDGE_' || true)

VENV=${SCHEMATHESIS_VENV:-$HOME/.cache/nudge/schemathesis-venv}
MAX_EXAMPLES=${SCHEMATHESIS_MAX_EXAMPLES:-250}
SEED=${SCHEMATHESIS_SEED:-1}
MIN_CASES=1000
DB=nudge_schemathesis_$$
PG="env PGOPTIONS=--client-min-messages=warning psql -h 127.0.0.1 -U postgres -v ON_ERROR_STOP=1 -q"

say() { printf 'schemathesis.sh: %s\n' "$*"; }
die() { printf 'schemathesis.sh: error: %s\n' "$*" >&2; exit 1; }

work=$(mktemp -d -t nudge-schemathesis.XXXXXX)
intake_pid=
cleanup() {
  local status=$?
  set +e
  if [[ -n $intake_pid ]]; then
    kill -TERM "$intake_pid" 2>/dev/null
    local deadline=$((SECONDS + 15))
    while kill -0 "$intake_pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    kill -KILL "$intake_pid" 2>/dev/null
    wait "$intake_pid" 2>/dev/null
  fi
  $PG -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1
  if ((status == 0)); then
    rm -rf "$work"
  else
    say "failed (exit $status); logs kept in $work" >&2
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [[ ! -x $VENV/bin/schemathesis ]]; then
  say "installing schemathesis from PyPI into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --index-url https://pypi.org/simple schemathesis
fi

if [[ -n $bin_dir_wanted ]]; then
  BIN_DIR=$(cd "$bin_dir_wanted" && pwd)
else
  cargo build --locked -q -p nudge-intake -p nudgectl
  BIN_DIR=${CARGO_TARGET_DIR:-$ROOT/target}/debug
fi

$PG -c "CREATE DATABASE $DB"
export NUDGE_DATABASE__URL=postgres://postgres@127.0.0.1:5432/$DB
NUDGE_CRYPTO__DESTINATION_KEY=$(head -c 32 /dev/urandom | base64)
NUDGE_CRYPTO__SUBSCRIBER_KEY=$(head -c 32 /dev/urandom | base64)
export NUDGE_CRYPTO__DESTINATION_KEY NUDGE_CRYPTO__SUBSCRIBER_KEY
export NUDGE_ACTOR=schemathesis
"$BIN_DIR/nudgectl" migrate >/dev/null
tenant=schemathesis-clinic
"$BIN_DIR/nudgectl" tenant create "$tenant" >/dev/null
secret=$("$BIN_DIR/nudgectl" tenant secret rotate "$tenant" --reason "schemathesis run" 2>/dev/null)

NUDGE_INTAKE__LISTEN_ADDR=127.0.0.1:0 NUDGE_TELEMETRY__LOG_FORMAT=json \
  NUDGE_TELEMETRY__LOG_FILTER=warn "$BIN_DIR/nudge-intake" >"$work/intake.out" 2>"$work/intake.log" &
intake_pid=$!
deadline=$((SECONDS + 20))
until url=$(grep -o 'http://[0-9.:]*' "$work/intake.out" 2>/dev/null); do
  ((SECONDS < deadline)) || die "nudge-intake did not report its address within 20s"
  kill -0 "$intake_pid" 2>/dev/null || die "nudge-intake exited: $(tail -n 5 "$work/intake.log")"
  sleep 0.2
done
say "intake at $url, tenant $tenant"

export NUDGE_ST_SECRET=$secret NUDGE_ST_TENANT=$tenant
set +e
# Run from the work directory: Schemathesis keeps a cache in the current directory.
# One worker: with two threads, Hypothesis's describing of strategies (ast.parse) sometimes
# trips CPython 3.11's thread-unsafe AST constructor ("SystemError: AST constructor recursion
# depth mismatch"), a runtime error of the tool, not an answer of the intake.
(cd "$work" && PYTHONPATH="$ROOT/scripts" PYTHONDONTWRITEBYTECODE=1 SCHEMATHESIS_HOOKS=schemathesis_hooks \
  "$VENV/bin/schemathesis" run "$ROOT/docs/openapi.json" \
  --url "$url" \
  --checks not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance \
  --max-examples "$MAX_EXAMPLES" \
  --seed "$SEED" \
  --workers 1 \
  --no-color) 2>&1 | tee "$work/schemathesis.txt"
status=${PIPESTATUS[0]}
set -e
((status == 0)) || die "schemathesis found failures (exit $status)"
cases=$(grep -oE '[0-9]+ generated' "$work/schemathesis.txt" | tail -1 | grep -oE '[0-9]+' || echo 0)
((cases >= MIN_CASES)) || die "only $cases generated cases (at least $MIN_CASES required)"
if grep -qE '"level": ?"ERROR"' "$work/intake.log"; then
  die "the intake logged errors: $(grep -E '"level": ?"ERROR"' "$work/intake.log" | head -3)"
fi
say "$cases generated cases, no server error, every answer within the contract"
