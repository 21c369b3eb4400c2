#!/usr/bin/env bash
# The fairness benchmark (see tests/e2e/src/bin/fairness-bench.rs; issue 24): builds the release
# binaries it runs, makes sure PostgreSQL and RabbitMQ answer, and sends several tenants' SMS
# through one provider account (the real producer, janitor and two SMS workers, the stub's token
# bucket):
#   two      tenant big 9,000 SMS due now + tenant small 20 due 15 s later, the account at 40/s:
#            small's lateness p50/p99/max (target p99 <= 2 s), big's drain against its floor of
#            225 s (target within 3%), 429s (target 0);
#   hundred  100 tenants x 100 SMS due together, the account at 200/s: each tenant's last
#            delivery (target: all within 10% of each other), each tenant's p99 lateness
#            (target: none above 1.2x the mean), the drain against its floor of 50 s, 429s.
# Each case runs --runs times (default 3, interleaved); the table gives the median and the worst
# run. Writes bench/results/fairness-<scale>-<UTC stamp>.json and
# bench/results/fairness-<scale>-latest.md (or under --results DIR). After the build, about
# 8 minutes a run of both cases at full scale (--runs 3: about 25 minutes), about 2 minutes a
# run at --scale small (a tenth: 900 + 20; 10 tenants x 100).
#   scripts/bench-fairness.sh [--case two|hundred|all] [--scale full|small] [--runs N] [--results DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
cargo build --release --locked --workspace --bin nudge-sms --bin nudge-producer \
    --bin nudge-janitor --bin provider-stub --bin fairness-bench
target/release/fairness-bench "$@"
