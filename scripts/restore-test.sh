#!/usr/bin/env bash
# The restore drill (see tests/e2e/src/bin/restore-drill.rs): a PostgreSQL server of its own
# (the shared one on 5432 is not touched), the real producer, janitor and two SMS workers, 5,000
# SMS on a provider-stub account that does not dedup by key. A pg_dump of the ledger mid-run,
# the run finished, the ledger restored from the dump, a worker refused on it, `nudgectl restore
# reconcile` (dry run, then --execute with the stub's message log), the producer and workers
# started again. Writes bench/results/restore-*.json and bench/results/restore-latest.md; fails
# if a key was sent twice or a delivery is missing. A few minutes after the build.
#   scripts/restore-test.sh [--deliveries N] [--backup-at SHARE] [--rate PER_SECOND]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
cargo build --workspace --bins --locked
target/debug/restore-drill "$@"
