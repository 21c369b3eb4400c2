#!/usr/bin/env bash
# What the delivery-event triggers cost PostgreSQL per delivery (decisions 0603, 0605-0608),
# without the services around them: a scratch database migrated by `nudgectl migrate`, 20,000
# SMS deliveries, and pgbench running a cycle of the engine's own statement shapes on batches of
# --batch deliveries (default 5, as a running pipeline's statements are small): the claim
# (`scheduled` to `queued`), the lease (to `sending`), the record (to `delivered`, the `sent`
# event) and a reset to `scheduled`, in one transaction.
#
# Variants, interleaved, --runs times each (default 5):
#   off          the event triggers disabled (`deliveries_event_count`, `_events_inserted`,
#                `_events_updated`), as the throughput benchmark's `--events off`;
#   on           the triggers as migrated;
#   on-mapping   as `on`, but the count trigger called WHEN the mapping names an event (its
#                condition before migration 20261226000001), to show what 0607 saved;
#   on-position-key  as `on`, but `position` under a unique constraint indexing every event
#                (unnumbered ones as NULL), as before migration 20261227000001 (0608).
# After each run the sequencer numbers the run's events (calls of up to 100,000, one session),
# measured on its own.
# Measures the PostgreSQL cluster's CPU (the postmaster, its children and the children it has
# reaped, from /proc): run it on the database's own host, with nothing else using it. Prints
# the median and the worst run per variant in us per delivery (and per event numbered), and
# writes bench/results/event-triggers-<UTC stamp>.md (or under --results DIR).
#   scripts/bench-event-triggers.sh [--runs N] [--batch N] [--cycles N] [--results DIR]
set -euo pipefail
cd "$(dirname "$0")/.."

runs=5
batch=5
cycles=1500
results=bench/results
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --batch) batch=$2; shift 2 ;;
    --cycles) cycles=$2; shift 2 ;;
    --results) results=$2; shift 2 ;;
    -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
for n in "$runs" "$batch" "$cycles"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "--runs, --batch and --cycles take a positive count" >&2; exit 2; }
done
deliveries=20000
(( batch <= deliveries )) || { echo "--batch is at most $deliveries" >&2; exit 2; }

scripts/services.sh
command -v pgbench >/dev/null || { echo "pgbench is missing (Debian: postgresql-client)" >&2; exit 1; }
admin=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
db=nudge_bench_event_triggers
url="${admin%/*}/$db"
data_dir=$(psql "$admin" -Atc "SHOW data_directory")
postmaster=$(head -1 "$data_dir/postmaster.pid" 2>/dev/null) || {
  echo "cannot read $data_dir/postmaster.pid: run this on the database's host" >&2; exit 1; }

cargo build --release --locked -p nudgectl --bins
work=$(mktemp -d)
trap 'psql "$admin" -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null ||
  echo "could not drop the scratch database $db: drop it by hand" >&2; rm -rf "$work"' EXIT
psql "$admin" -qc "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db"
NUDGE_DATABASE__URL="$url" target/release/nudgectl migrate >/dev/null

psql "$url" -q -v ON_ERROR_STOP=1 -v n=$deliveries <<'SQL'
INSERT INTO tenants (id, name, created_at, updated_at)
VALUES ('00000000-0000-4000-8000-000000000001', 'bench', now(), now());
WITH r AS (
    INSERT INTO reminders (id, tenant_id, event_id, subscriber_ref, channels, scheduled_at,
                           expires_at, created_at)
    SELECT gen_random_uuid(), '00000000-0000-4000-8000-000000000001', 'bench-' || g, 'p',
           ARRAY['sms'], now() - g * interval '1 millisecond', now() + interval '1 day', now()
    FROM generate_series(1, :n) g
    RETURNING id, tenant_id, scheduled_at, expires_at)
INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state, idempotency_key,
                        scheduled_at, expires_at, next_attempt_at, created_at, updated_at)
SELECT gen_random_uuid(), r.id, r.tenant_id, 'sms', 'scheduled', 'nudge-' || r.id || '-sms',
       r.scheduled_at, r.expires_at, r.scheduled_at, now(), now()
FROM r;
CREATE TABLE bench_batches AS
    SELECT id, (row_number() OVER (ORDER BY id) - 1) AS rn FROM deliveries;
CREATE INDEX ON bench_batches (rn);
-- The count trigger's condition before migration 20261226000001, for `on-mapping`.
CREATE FUNCTION bench_count_always() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.event_seq := OLD.event_seq + 1;
    RETURN NEW;
END $$;
CREATE TRIGGER deliveries_event_count_mapping BEFORE UPDATE OF state, scheduled_at ON deliveries
    FOR EACH ROW WHEN (nudge_delivery_event_kind(OLD.state, NEW.state, OLD.scheduled_at,
                                                 NEW.scheduled_at, OLD.last_error_reason,
                                                 NEW.last_error_reason) IS NOT NULL)
    EXECUTE FUNCTION bench_count_always();
ALTER TABLE deliveries DISABLE TRIGGER deliveries_event_count_mapping;
SELECT nudge_sequence_delivery_events(100000);
ANALYZE;
SQL

batches=$((deliveries / batch))
cat > "$work/cycle.pgb" <<EOF
\set b random(0, $((batches - 1)))
BEGIN;
UPDATE deliveries d SET state = 'queued', queued_at = now(), updated_at = now()
FROM bench_batches i WHERE i.rn >= :b * $batch AND i.rn < (:b + 1) * $batch AND d.id = i.id;
UPDATE deliveries d SET state = 'sending', lease_owner = 'bench', queued_at = NULL,
    lease_expires_at = now() + interval '1 minute', generation = generation + 1
FROM bench_batches i WHERE i.rn >= :b * $batch AND i.rn < (:b + 1) * $batch AND d.id = i.id;
UPDATE deliveries d SET state = 'delivered', settled_at = now(), lease_owner = NULL,
    lease_expires_at = NULL, provider_message_id = 'bench', next_attempt_at = NULL
FROM bench_batches i WHERE i.rn >= :b * $batch AND i.rn < (:b + 1) * $batch AND d.id = i.id;
UPDATE deliveries d SET state = 'scheduled', settled_at = NULL, next_attempt_at = d.scheduled_at
FROM bench_batches i WHERE i.rn >= :b * $batch AND i.rn < (:b + 1) * $batch AND d.id = i.id;
COMMIT;
EOF

cat > "$work/number.sql" <<'SQL'
DO $$
DECLARE n integer; total bigint := 0;
BEGIN
    LOOP
        n := nudge_sequence_delivery_events(100000);
        EXIT WHEN n <= 0;
        total := total + n;
    END LOOP;
    PERFORM set_config('bench.numbered', total::text, false);
END $$;
SELECT current_setting('bench.numbered');
SQL

triggers() {
  local count=$1 mapping=$2 others=$3
  psql "$url" -q -v ON_ERROR_STOP=1 -c "ALTER TABLE deliveries
      $count TRIGGER deliveries_event_count, $mapping TRIGGER deliveries_event_count_mapping,
      $others TRIGGER deliveries_events_inserted, $others TRIGGER deliveries_events_updated"
}

# CPU seconds of the cluster: the postmaster with the children it reaped, and its live children.
cluster_cpu() {
  local ticks
  ticks=$(awk '{print $14 + $15 + $16 + $17}' "/proc/$postmaster/stat")
  for child in $(pgrep -P "$postmaster"); do
    ticks=$((ticks + $(awk '{print $14 + $15}' "/proc/$child/stat" 2>/dev/null || echo 0)))
  done
  echo "$ticks $(getconf CLK_TCK)" | awk '{printf "%.3f", $1 / $2}'
}

# A backend's CPU reaches the postmaster's count once it has exited and been reaped: wait for
# the cluster to be back to the processes it had idle.
idle=$(pgrep -c -P "$postmaster")
for _ in $(seq 20); do
  sleep 0.5
  now=$(pgrep -c -P "$postmaster")
  (( now == idle )) && break
  idle=$now
done
wait_idle() {
  for _ in $(seq 100); do
    (( $(pgrep -c -P "$postmaster") <= idle )) && return 0
    sleep 0.1
  done
  echo "PostgreSQL still has more processes than when idle after 10 s: is something else using it?" >&2
  exit 1
}

# The position index before 0608, for `on-position-key`, or as migrated.
position_index() {
  if [ "$1" = key ]; then
    psql "$url" -q -1 -v ON_ERROR_STOP=1 -c "DROP INDEX delivery_events_position_idx" \
      -c "ALTER TABLE delivery_events ADD CONSTRAINT delivery_events_position_key UNIQUE (position)"
  else
    psql "$url" -q -1 -v ON_ERROR_STOP=1 \
      -c "ALTER TABLE delivery_events DROP CONSTRAINT delivery_events_position_key" \
      -c "CREATE UNIQUE INDEX delivery_events_position_idx ON delivery_events (position)
            WHERE position IS NOT NULL"
  fi
}

variants=(off on on-mapping on-position-key)
declare -A samples numbering
for run in $(seq 1 "$runs"); do
  for variant in "${variants[@]}"; do
    case $variant in
      off) triggers DISABLE DISABLE DISABLE ;;
      on) triggers ENABLE DISABLE ENABLE ;;
      on-mapping) triggers DISABLE ENABLE ENABLE ;;
      on-position-key) triggers ENABLE DISABLE ENABLE ;;
    esac
    psql "$url" -q -v ON_ERROR_STOP=1 -c "VACUUM deliveries" -c "DELETE FROM delivery_events" \
      -c "VACUUM delivery_events"
    if [ "$variant" = on-position-key ]; then position_index key; fi
    wait_idle
    before=$(cluster_cpu)
    PGOPTIONS='-c synchronous_commit=off' pgbench -n -M prepared -c 1 -t "$cycles" \
      -f "$work/cycle.pgb" "$url" > "$work/pgbench.out" 2>&1 || {
      cat "$work/pgbench.out" >&2; exit 1; }
    wait_idle
    after=$(cluster_cpu)
    us=$(awk -v a="$before" -v b="$after" -v n=$((cycles * batch)) \
      'BEGIN { printf "%.1f", (b - a) * 1e6 / n }')
    samples[$variant]+="$us "
    echo "run $run: $variant: $us us of PostgreSQL CPU per delivery" >&2
    # The sequencer numbers at most 100,000 events a call: called until it numbers none, in
    # one session, and the events counted from what it answers.
    wait_idle
    before=$(cluster_cpu)
    events=$(psql "$url" -q -At -v ON_ERROR_STOP=1 -f "$work/number.sql")
    if (( events > 0 )); then
      wait_idle
      numbered=$(cluster_cpu)
      us=$(awk -v a="$before" -v b="$numbered" -v n="$events" \
        'BEGIN { printf "%.1f", (b - a) * 1e6 / n }')
      numbering[$variant]+="$us "
      echo "run $run: $variant: numbering $events events: $us us each" >&2
    fi
    if [ "$variant" = on-position-key ]; then position_index partial; fi
  done
done
triggers ENABLE DISABLE ENABLE

# One row of a table: the variant, the median and the worst (highest) of its runs, the runs.
table_row() {
  # shellcheck disable=SC2086
  printf '%s\n' $2 | sort -n | awk -v v="$1" \
    '{ x[NR] = $1 } END { m = (NR % 2) ? x[(NR + 1) / 2] : (x[NR / 2] + x[NR / 2 + 1]) / 2;
       printf "| %s | %.1f | %.1f |", v, m, x[NR] }'
  echo " $2|"
}

stamp=$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$results"
out="$results/event-triggers-$stamp.md"
{
  echo "# Event triggers: PostgreSQL CPU per delivery ($stamp)"
  echo
  echo "\`scripts/bench-event-triggers.sh --runs $runs --batch $batch --cycles $cycles\` on" \
    "$(nproc) cores; a cycle of claim, lease, record (\`sent\`) and reset on $batch deliveries" \
    "a statement, one transaction, $cycles cycles a run."
  echo
  echo "| variant | median us/delivery | worst run | runs |"
  echo "|---|---|---|---|"
  for variant in "${variants[@]}"; do
    table_row "$variant" "${samples[$variant]}"
  done
  echo
  echo "Numbering a run's events afterwards, by the sequencer in one session (the CPU's clock" \
    "ticks at 1/$(getconf CLK_TCK) s, about $(awk -v t="$(getconf CLK_TCK)" -v n=$((cycles * batch)) \
      'BEGIN { printf "%.1f", 1e6 / t / n }') us an event at one event per delivery):"
  echo
  echo "| variant | median us/event | worst run | runs |"
  echo "|---|---|---|---|"
  for variant in "${variants[@]}"; do
    if [ -n "${numbering[$variant]:-}" ]; then table_row "$variant" "${numbering[$variant]}"; fi
  done
} > "$out"
cat "$out"
