#!/usr/bin/env bash
# The recovery benchmark (see tests/e2e/src/bin/recovery-bench.rs; issue 23): builds the release
# binaries it runs, makes sure PostgreSQL and RabbitMQ answer, and runs 8,000 SMS due at once
# through a producer, a janitor and two SMS workers (bucket 300/s, an account that does not
# dedup by key) with a fault 6 s after the first provider request: none (baseline), one worker
# SIGKILLed, RabbitMQ's app stopped for 3 s, PostgreSQL restarted fast. The broker and the
# database that are stopped are the run's own (Debian's packages on free loopback ports); the
# shared ones stay up. Writes bench/results/recovery-<UTC stamp>.json and
# bench/results/recovery-latest.md. About two minutes a run after the build (--runs 3: 12 runs).
#   scripts/bench-recovery.sh [--runs N] [--scenario baseline|worker-sigkill|rabbitmq-restart|postgresql-restart]...
#                             [--deliveries N] [--fault-at-s S] [--run-timeout-s S]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
cargo build --release --locked --workspace --bin nudge-sms --bin nudge-producer \
    --bin nudge-janitor --bin provider-stub --bin recovery-bench
target/release/recovery-bench "$@"
