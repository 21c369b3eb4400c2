#!/usr/bin/env bash
# The demo's own steps, shared by scripts/demo.sh (processes on this machine) and the `demo`
# service of docker-compose.yml: create a tenant and its signing secret, post generated reminders
# due over the next few seconds to nudge-intake over HTTP (signed, in batches of 100), give the
# tenant a schedule, then print progress until nothing is owed (bounded), the
# final `nudgectl status`, and a summary of what the provider stub saw. It checks that the
# provider accepted every delivery the reminders asked for.
#
# Expects the nudge binaries (the intake included) to be running already against the same
# database and broker, and nudgectl configured (NUDGE_CONFIG or NUDGE_* variables, including
# crypto.destination_key). Needs bash, GNU date, curl, jq and openssl (the signatures).
#
# Environment (all optional):
#   NUDGECTL          nudgectl command                    (default: nudgectl on PATH)
#   STUB_URL          provider stub base URL, for /stats  (default: http://127.0.0.1:8080)
#   INTAKE_URL        nudge-intake base URL               (default: http://127.0.0.1:8090)
#   DEMO_TENANT       a tenant without a schedule yet     (default: a new demo-clinic-<UTC time>)
#   DEMO_REMINDERS    number of reminders                 (default: 300)
#   DEMO_SPREAD_S     due over the next N seconds         (default: 10)
#   DEMO_TIMEOUT_S    give up waiting after N seconds     (default: 120)
#   DEMO_WORK_DIR     where the reminders file is written (default: a temporary directory)
# Exit status: 0 when every delivery was accepted, 1 on timeout, a shortfall or a failed step.
set -euo pipefail

NUDGECTL=${NUDGECTL:-nudgectl}
STUB_URL=${STUB_URL:-http://127.0.0.1:8080}
INTAKE_URL=${INTAKE_URL:-http://127.0.0.1:8090}
TENANT=${DEMO_TENANT:-demo-clinic-$(date -u +%Y%m%dT%H%M%S)}
COUNT=${DEMO_REMINDERS:-300}
SPREAD=${DEMO_SPREAD_S:-10}
TIMEOUT=${DEMO_TIMEOUT_S:-120}
export NUDGE_ACTOR=${NUDGE_ACTOR:-demo}

say() { printf 'demo: %s\n' "$*"; }
die() { printf 'demo: error: %s\n' "$*" >&2; exit 1; }

for tool in curl jq date openssl; do
  command -v "$tool" >/dev/null || die "$tool is needed"
done
ctl() { $NUDGECTL "$@"; }

if [[ -n ${DEMO_WORK_DIR:-} ]]; then
  work=$DEMO_WORK_DIR
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi

# The stub must answer before anything is sent, or the first sends fail and are retried.
deadline=$((SECONDS + 30))
until curl -fsS -o /dev/null "$STUB_URL/stats"; do
  ((SECONDS < deadline)) || die "provider stub at $STUB_URL did not answer within 30s"
  sleep 0.5
done

until curl -fsS -o /dev/null "$INTAKE_URL/readyz"; do
  ((SECONDS < deadline)) || die "nudge-intake at $INTAKE_URL was not ready within 30s"
  sleep 0.5
done

say "tenant $TENANT: $(ctl tenant create "$TENANT")"
# The secret is printed once; the demo keeps it only in this shell.
secret=$(ctl tenant secret rotate "$TENANT" --reason 'demo: the clinic signs its posts' 2>/dev/null)

# Reminders due over the next $SPREAD seconds, cycling through five channel sets so that every
# channel gets work and some reminders go out on two channels.
now=$(date -u +%s)
run_id=$now
declare -a due_at expire_at
for ((s = 0; s <= SPREAD; s++)); do
  due_at[s]=$(date -u -d "@$((now + 1 + s))" +%Y-%m-%dT%H:%M:%SZ)
  expire_at[s]=$(date -u -d "@$((now + 1 + s + 3600))" +%Y-%m-%dT%H:%M:%SZ)
done
last_due=$((now + 1 + SPREAD))
sets=('"push"' '"email"' '"sms"' '"push","sms"' '"email","sms"')
expected=0
reminders=$work/demo-reminders.jsonl
: >"$reminders"
for ((i = 0; i < COUNT; i++)); do
  s=$((i % (SPREAD + 1)))
  channels=${sets[i % 5]}
  dest=''
  [[ $channels == *push* ]] && dest+="\"push\":\"demo-device-$i\","
  [[ $channels == *email* ]] && dest+="\"email\":\"patient$i@example.org\","
  if [[ $channels == *sms* ]]; then
    printf -v sms '"sms":"+1555%07d",' "$i"
    dest+=$sms
  fi
  commas=${channels//[^,]/}
  expected=$((expected + ${#commas} + 1))
  printf '{"event_id":"demo-%s-%d","subscriber_ref":"patient-%d","channels":[%s],"scheduled_at":"%s","expires_at":"%s","destinations":{%s},"content":{"template":"appointment","demo":true}}\n' \
    "$run_id" "$i" "$i" "$channels" "${due_at[s]}" "${expire_at[s]}" "${dest%,}" \
    >>"$reminders"
done
say "posting $COUNT reminders ($expected deliveries) to $INTAKE_URL, due from ${due_at[0]} to ${due_at[SPREAD]}"
accepted() { curl -fsS "$STUB_URL/stats" | jq '.total.accepted'; }
accepted_before=$(accepted)
# Post first, then schedule, into a tenant that has no schedule yet (a new one per run): then no
# producer window runs while the reminders are imported. Both alternatives lose reminders in
# the current ledger: a window materialised concurrently with a post misses the reminders
# still uncommitted, and a reminder imported into a paused tenant for a window that already ran
# never gets deliveries after the resume.
# Signed as a clinic's application signs (scheme v2): HMAC-SHA256 under the secret of
# "<unix time>\n<METHOD>\n<path>\n<body>", the path exactly as the request sends it.
post() { # body file
  local t sig path=/v1/tenants/$TENANT/reminders
  t=$(date -u +%s)
  sig=$( { printf '%s\nPOST\n%s\n' "$t" "$path"; cat "$1"; } |
    openssl dgst -sha256 -hmac "$secret" -r | cut -d' ' -f1)
  curl -fsS -X POST "$INTAKE_URL$path" \
    -H 'content-type: application/json' -H "nudge-signature: t=$t,v2=$sig" \
    -H "x-correlation-id: demo-$run_id" --data-binary "@$1"
}
batch=$work/demo-batch.json
posted=0
while ((posted < COUNT)); do
  sed -n "$((posted + 1)),$((posted + 100))p" "$reminders" | jq -cs '{reminders: .}' >"$batch"
  answer=$(post "$batch") || die "the intake refused a batch"
  bad=$(jq '[.results[] | select(.status != 202 and .status != 200)] | length' <<<"$answer")
  ((bad == 0)) || die "the intake did not accept $bad reminders: $(jq -c '[.results[] | select(.status != 202 and .status != 200)][0]' <<<"$answer")"
  posted=$((posted + $(jq '.results | length' <<<"$answer")))
done
say "the intake recorded $posted reminders"
# Every second, materialise what is due in the next 5 s (the first window catches up on
# everything already due).
ctl schedule set "$TENANT" --cron '* * * * * *' --window-seconds 5 \
  --reason 'demo: materialise every second'

owed() {
  ctl status --json | jq '[.[] | .scheduled + .queued + .sending + .retry_wait] | add'
}

started=$SECONDS
deadline=$((SECONDS + TIMEOUT))
while true; do
  left=$(owed) || die "nudgectl status failed"
  now_accepted=$(accepted) || die "the provider stub at $STUB_URL stopped answering"
  say "t+$((SECONDS - started))s owed=$left delivered=$((now_accepted - accepted_before))"
  # Owed work is counted from deliveries, which the producer creates one window ahead, so
  # "nothing owed" only means done once the last reminder's time has come.
  if ((left == 0 && $(date -u +%s) > last_due)); then
    break
  fi
  if ((SECONDS >= deadline)); then
    ctl status || true
    die "still $left deliveries owed after ${TIMEOUT}s"
  fi
  sleep 2
done

say "nothing owed after $((SECONDS - started))s; nudgectl status:"
ctl status
say "provider stub /stats (per account: requests, accepted, duplicates, answers by status):"
curl -fsS "$STUB_URL/stats" | jq -r '
  (.accounts | to_entries[] |
    "  \(.key): requests=\(.value.requests) accepted=\(.value.accepted) duplicates=\(.value.duplicates) by_status=\(.value.by_status | tostring)"),
  "  total: requests=\(.total.requests) accepted=\(.total.accepted) duplicates=\(.total.duplicates) by_status=\(.total.by_status | tostring)"'
delivered=$(($(accepted) - accepted_before))
if ((delivered != expected)); then
  die "the provider accepted $delivered of the $expected deliveries (see dead_lettered and ambiguous above)"
fi
say "all $expected deliveries of $COUNT reminders accepted by the provider"
