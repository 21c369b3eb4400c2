#!/usr/bin/env bash
# First start: create the cluster (trust authentication, UTF-8) and the database POSTGRES_DB
# (default nudge). Every start: run the server in the foreground, listening on all interfaces.
set -euo pipefail
: "${PGDATA:?}"
db=${POSTGRES_DB:-nudge}

if [[ ! -s $PGDATA/PG_VERSION ]]; then
  echo "postgres: creating the cluster in $PGDATA and the database $db"
  initdb --pgdata="$PGDATA" --username=postgres --encoding=UTF8 --locale=C.UTF-8 \
    --auth=trust >/dev/null
  echo 'host all all all trust' >>"$PGDATA/pg_hba.conf"
  # Socket only while setting up, so that nobody connects before the database exists.
  pg_ctl --pgdata="$PGDATA" --options="-c listen_addresses=''" --wait --silent start
  createdb --username=postgres "$db"
  pg_ctl --pgdata="$PGDATA" --mode=fast --wait --silent stop
fi

exec postgres -D "$PGDATA" -c listen_addresses='*'
