#!/usr/bin/env bash
# The PostgreSQL failover drill (see tests/e2e/src/bin/pg-failover-drill.rs): starts a primary
# and a hot standby from this machine's PostgreSQL packages (their own ports and directories;
# the shared server on 5432 is not touched), a loopback proxy standing in for the read-write
# Service, and 10,000 SMS deliveries through the real binaries on an account that does not
# dedup by key. Once a quarter are delivered it kills the primary (SIGKILL), promotes the
# standby and points the proxy at it. Writes bench/results/pg-failover-<mode>-*.json and
# bench/results/pg-failover-latest.md; with synchronous replication (the default) it fails if
# a delivery was lost, a key was sent twice or deliveries did not move within 15 s of the
# promotion. `--replication async` runs the same drill without a synchronous standby, to show
# what that costs (it reports, it does not fail). A few minutes after the build.
#   scripts/postgres-failover-test.sh [--replication sync|async] [--deliveries N] [--rate R]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
cargo build --workspace --bins --locked
target/debug/pg-failover-drill "$@"
