#!/usr/bin/env bash
# The drain benchmark (see tests/e2e/src/bin/drain-bench.rs): builds the binaries, makes sure
# PostgreSQL and RabbitMQ answer, runs the scenarios and writes bench/results/drain-*.json and
# bench/results/drain-latest.md. Takes about four minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
cargo build --workspace --bins --locked
target/debug/drain-bench
