#!/usr/bin/env bash
# The throughput benchmark (see tests/e2e/src/bin/throughput-bench/main.rs): builds the binaries
# in release mode, makes sure PostgreSQL and RabbitMQ answer, runs the cases and writes
# bench/results/throughput-*.json and bench/results/throughput-latest.md.
#
#   scripts/bench-throughput.sh                    20,000 SMS, 3 runs per case (~15 minutes)
#   scripts/bench-throughput.sh --deliveries 5000 --runs 1      a quick look
#   scripts/bench-throughput.sh --scale            adds the large-ledger and large-window cases
#
# Statements per delivery need pg_stat_statements preloaded by the server. When it is not,
# they are reported as n/a, unless NUDGE_BENCH_ALLOW_PG_RESTART=1: then this script adds it to
# shared_preload_libraries (ALTER SYSTEM) and restarts the local PostgreSQL, which interrupts
# everything else using that server.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}

preload=$(psql "$DATABASE_URL" -Atc "SHOW shared_preload_libraries")
if [[ $preload != *pg_stat_statements* ]]; then
  if [[ ${NUDGE_BENCH_ALLOW_PG_RESTART:-0} == 1 ]]; then
    libraries=${preload:+$preload,}pg_stat_statements
    echo "bench: preloading pg_stat_statements and restarting PostgreSQL" >&2
    psql "$DATABASE_URL" -qc "ALTER SYSTEM SET shared_preload_libraries = '$libraries'"
    version=$(ls /etc/postgresql | sort -V | tail -n 1)
    pg_ctlcluster --skip-systemctl-redirect "$version" main restart
    for _ in $(seq 1 60); do
      pg_isready -q -h 127.0.0.1 -p 5432 && break
      sleep 1
    done
    pg_isready -q -h 127.0.0.1 -p 5432
  else
    echo "bench: pg_stat_statements is not preloaded: statements per delivery will be n/a" \
      "(NUDGE_BENCH_ALLOW_PG_RESTART=1 lets this script enable it and restart PostgreSQL)" >&2
  fi
fi

cargo build --release --locked -p provider-stub -p nudge-producer -p nudge-janitor -p nudge-sms \
  -p nudgectl -p nudge-e2e --bins
exec target/release/throughput-bench "$@"
