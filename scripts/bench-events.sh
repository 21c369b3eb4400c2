#!/usr/bin/env bash
# The events push benchmark (see tests/e2e/src/bin/events-bench.rs; issue 28): builds the
# release binaries it runs, makes sure PostgreSQL and RabbitMQ answer, and measures how
# nudge-events pushes one tenant's delivery events to a receiver on 127.0.0.1 beside the real
# producer, janitor and an SMS worker:
#   rate  20,000 SMS due now: the pipeline's deliveries/s, the events pushed/s (target: at
#         least the deliveries/s), how long after the last change the last event arrived;
#   lag   1,000 deliveries/s for 20 s: lag from each event's change to its POST, p50, p99
#         (target: under 1 s) and max, and events received/s.
# Every event must arrive (duplicates, gaps and out-of-order events are counted). Each case runs
# --runs times (default 3, interleaved); the table gives the median and the worst run. Writes
# bench/results/events-full-<UTC stamp>.json and bench/results/events-full-latest.md (or under
# --results DIR).
#   scripts/bench-events.sh [--case rate|lag|all] [--runs N] [--results DIR]
#                           [--events-interval-ms MS] [--poll-interval-ms MS] [--batch-max N]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}

cargo build --release --locked -p provider-stub -p nudge-producer -p nudge-janitor -p nudge-sms \
  -p nudge-events -p nudgectl -p nudge-e2e --bins
exec target/release/events-bench "$@"
