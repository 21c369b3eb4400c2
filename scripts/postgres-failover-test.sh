#!/usr/bin/env bash
# The PostgreSQL failover drill (see tests/e2e/src/bin/pg-failover-drill.rs): starts a primary
# and a hot standby from this machine's PostgreSQL packages (their own ports and directories;
# the shared server on 5432 is not touched), a loopback proxy standing in for the read-write
# Service, and 10,000 SMS deliveries through the real binaries on an account that does not
# dedup by key. Once a quarter are delivered it kills the primary (SIGKILL), promotes the
# standby and points the proxy at it. Writes bench/results/pg-failover-<mode>-*.json and
# bench/results/pg-failover-latest.md; with synchronous replication (the default) it fails if
# a delivery was neither delivered nor held `ambiguous` for review, a key was sent twice,
# deliveries did not move within 15 s of the promotion, or an outcome the primary had
# committed is missing on the promoted standby.
# `--replication async` runs the same drill without a synchronous standby, to show what that
# costs (it reports, it does not fail). The standby streams through a loopback proxy, stalled
# `--standby-lag-ms` (3000 by default; 0: not stalled) before the kill, as a slow or congested
# link: an asynchronous standby lacks those seconds of committed outcomes at its promotion, a
# synchronous primary's commits wait instead. Every argument goes to the drill. A few minutes
# after the build.
#   scripts/postgres-failover-test.sh [--replication sync|async] [--deliveries N] [--rate R]
#                                     [--standby-lag-ms MS] [--settle-within-s S]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
cargo build --workspace --bins --locked
target/debug/pg-failover-drill "$@"
