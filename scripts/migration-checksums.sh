#!/usr/bin/env bash
# Prints the line of migrations/checksums.txt for every migration that is not listed there yet:
# version, file and SHA-384 of the file (the checksum sqlx stores in _sqlx_migrations and compares
# on every migrate). Append them after adding a migration:
#   scripts/migration-checksums.sh >> migrations/checksums.txt
# The lines already listed are never rewritten: an applied migration is never edited, renamed,
# renumbered or removed (docs/decisions/0017-migrations-are-immutable.md), and nudge-ledger's
# test migration_checksums fails when one is. `--all` prints every migration's line instead.
set -euo pipefail
cd "$(dirname "$0")/../migrations"
all=false
[[ ${1:-} == --all ]] && all=true
for file in [0-9]*_*.sql; do
  version=${file%%_*}
  if ! $all && grep -q "^$version " checksums.txt 2>/dev/null; then
    continue
  fi
  printf '%s %s %s\n' "$version" "$file" "$(sha384sum "$file" | cut -d' ' -f1)"
done
