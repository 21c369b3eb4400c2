#!/usr/bin/env bash
# The intake benchmark (see tests/e2e/src/bin/intake-bench.rs): builds the release binaries,
# makes sure PostgreSQL and RabbitMQ answer, posts signed reminders from 50 concurrent clients
# (20,000 by default; --posts N, --clients C) and writes bench/results/intake-*.json and
# bench/results/intake-latest.md. About a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
cargo build --release --workspace --bins --locked
target/release/intake-bench "$@"
