#!/usr/bin/env bash
# Runs every process of each Kubernetes overlay (deploy/k8s/overlays/*) as its pod would, with
# the manifest's command, environment and ConfigMap, against the PostgreSQL and RabbitMQ of
# scripts/services.sh (scripts/k8s_smoke.py says what it checks). Builds the binaries when
# missing (debug; NUDGE_BIN_DIR names others), and uses the virtualenv of
# scripts/validate-k8s.sh (K8S_VALIDATE_VENV), installing into it what is missing.
#
# Environment: K8S_SMOKE_PROBES=require|report (default require: every probe must answer 200).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
bin_dir_wanted=${NUDGE_BIN_DIR:-}
while read -r var; do unset "$var"; done < <(compgen -e | grep '^NUDGE_' || true)

VENV=${K8S_VALIDATE_VENV:-$HOME/.cache/nudge/k8s-venv}
say() { printf 'k8s-smoke.sh: %s\n' "$*"; }

if ! "$VENV/bin/python" -c 'import kubernetes_validate, yaml, pika' 2>/dev/null; then
  say "installing kubernetes-validate and pika from PyPI into $VENV"
  [[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --index-url https://pypi.org/simple kubernetes-validate pika
fi
scripts/services.sh
if [[ -n $bin_dir_wanted ]]; then
  export NUDGE_BIN_DIR=$bin_dir_wanted
else
  cargo build --locked -q --workspace --bins
fi
for overlay in deploy/k8s/overlays/*/; do
  # Its processes are the example overlay's, run above or below: it adds a Cluster, which needs
  # the operator, and database URLs, which the smoke replaces with the local server's.
  if [[ $overlay == */cloudnative-pg/ ]]; then
    say "$overlay: skipped (the example overlay's processes; the Cluster is validated offline by scripts/validate-k8s.sh)"
    continue
  fi
  say "$overlay"
  "$VENV/bin/python" scripts/k8s_smoke.py "$overlay" --probes "${K8S_SMOKE_PROBES:-require}"
done
