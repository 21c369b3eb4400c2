#!/usr/bin/env bash
# The RabbitMQ cluster drill (see tests/e2e/src/bin/cluster-drill.rs): starts three RabbitMQ
# nodes from this machine's packages as one cluster (their own names, ports and directories;
# the shared broker on 5672 is not touched), runs 10,000 SMS deliveries through the real
# binaries given all three addresses, stops the node leading work.sms mid-run and starts it
# again. Writes bench/results/cluster-*.json and bench/results/cluster-latest.md; fails if a
# delivery was lost or a key was sent twice. About 3 to 5 minutes after the build.
#   scripts/rabbitmq-cluster-test.sh [--deliveries N] [--send-delay-ms MS]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
cargo build --workspace --bins --locked
target/debug/cluster-drill "$@"
