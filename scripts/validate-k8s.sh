#!/usr/bin/env bash
# Validates the Kubernetes manifests (deploy/k8s) offline: no cluster, no registry.
#
# Installs kubernetes-validate from PyPI into a virtualenv when missing (K8S_VALIDATE_VENV,
# default ~/.cache/nudge/k8s-venv), then runs scripts/k8s_check.py on the base and every overlay:
# each is rendered (a checked kustomize subset, compared with `kubectl kustomize` when kubectl
# is on PATH), every resource validated strictly against the Kubernetes schemas of the versions
# below (the KEDA kinds against deploy/k8s/schemas/keda.schema.json), and nudge's own rules
# checked (probes on the configured ports, NUDGE_ variable names, grace periods longer than the
# shutdown grace, one PodDisruptionBudget per Deployment, each channel's ScaledObject on its
# work queue with a maximum within the channel's window, each Deployment's database URL its own
# role's, the console without a crypto key or a broker and with Secure cookies, each Service
# reaching one Deployment on a port it declares, and a CloudNativePG Cluster replicating
# synchronously with the binaries' roles, reached through its read-write Service). A self-test
# first breaks a rendering in known ways and requires each to be refused.
#
# Environment: K8S_VERSIONS (default "1.30.0 1.37.0": the oldest and newest checked).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

VENV=${K8S_VALIDATE_VENV:-$HOME/.cache/nudge/k8s-venv}
read -r -a versions <<<"${K8S_VERSIONS:-1.30.0 1.37.0}"
say() { printf 'validate-k8s.sh: %s\n' "$*"; }

# pika: scripts/k8s-smoke.sh, which shares this virtualenv, deletes its exchanges with it.
if ! "$VENV/bin/python" -c 'import kubernetes_validate, yaml, pika' 2>/dev/null; then
  say "installing kubernetes-validate and pika from PyPI into $VENV"
  [[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --index-url https://pypi.org/simple kubernetes-validate pika
fi
say "kubernetes-validate $("$VENV/bin/kubernetes-validate" --version)"
if command -v kubectl >/dev/null; then
  say "kubectl: $(command -v kubectl) (renderings compared with kubectl kustomize)"
else
  say "kubectl not found: renderings not compared with kubectl kustomize (the subset alone)"
fi

args=()
for v in "${versions[@]}"; do args+=(--kubernetes-version "$v"); done
overlays=(deploy/k8s/overlays/*/)
# The self-test breaks the CloudNativePG overlay: it holds every kind the checks know (the
# example overlay's resources and a Cluster).
"$VENV/bin/python" scripts/k8s_check.py "${args[@]}" --self-test deploy/k8s/overlays/cloudnative-pg \
  deploy/k8s/base "${overlays[@]}"
say "ok"
