#!/usr/bin/env bash
# The retention benchmark (see tests/e2e/src/bin/retention-bench.rs): builds the binaries in
# release mode, makes sure PostgreSQL and RabbitMQ answer, deletes a settled history beside a
# steadily delivering pipeline, and writes bench/results/retention-*.json and
# bench/results/retention-latest.md.
#
#   scripts/bench-retention.sh                          1,000,000 deliveries (bounded: the run
#                                                       is awaited at most --max-run-s, 1800 s)
#   scripts/bench-retention.sh --deliveries 100000 --window-s 30 --max-run-s 600   a quick look
#
# Run it on a quiet machine: it measures rates. Everything it starts is stopped at its end.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
nice -n "${NUDGE_BENCH_NICE:-0}" cargo build --release --locked -p provider-stub -p nudge-producer \
  -p nudge-janitor -p nudge-sms -p nudgectl -p nudge-e2e --bins
exec timeout "${NUDGE_BENCH_TIMEOUT_S:-3600}" target/release/retention-bench "$@"
