#!/usr/bin/env bash
# The drain benchmark (see tests/e2e/src/bin/drain-bench.rs): builds the release binaries,
# makes sure PostgreSQL and RabbitMQ answer, runs the scenarios and writes
# bench/results/drain-<scale>-*.json and bench/results/drain-<scale>-latest.md.
#   --scale seed   (default) B = 9,000 + N = 3,000 at 40/s, then with 2,000 dead letters
#                  redriven: about 15 minutes.
#   --scale small  a tenth of it, in four cases of bucket and 429 forms: about 6 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
cargo build --release --workspace --bins --locked
target/release/drain-bench "$@"
