#!/usr/bin/env bash
# Checks deploy/observability with promtool (Debian's `prometheus` package; scripts/services.sh
# installs it): the Prometheus configuration, the alert rules, their unit tests, and that every
# query of the Grafana dashboards parses. That every metric they read is exported is a Rust
# test (tests/e2e/tests/it/observability_catalog.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=deploy/observability

command -v promtool >/dev/null || { echo "promtool not found: run scripts/services.sh" >&2; exit 1; }
promtool check rules "$dir"/rules/*.yml
promtool test rules "$dir"/tests/*.yml

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# The configuration names its rules where the container mounts them: check it with the
# repository's rules in their place.
mkdir -p "$scratch/rules"
cp "$dir"/rules/*.yml "$scratch/rules/"
sed "s#/etc/prometheus/rules/#$scratch/rules/#" "$dir/prometheus.yml" >"$scratch/prometheus.yml"
promtool check config "$scratch/prometheus.yml"

# Every panel's query, as a recording rule, must parse.
python3 - "$scratch/panels.yml" "$dir"/grafana/*.json <<'PY'
import json, sys
out, dashboards = sys.argv[1], sys.argv[2:]
with open(out, "w") as f:
    f.write("groups:\n- name: panels\n  rules:\n")
    n = 0
    for path in dashboards:
        for panel in json.load(open(path))["panels"]:
            for target in panel.get("targets", []):
                f.write(f"  - record: panel:{n}\n    expr: {json.dumps(target['expr'])}\n")
                n += 1
print(f"{n} panel queries from {len(dashboards)} dashboard(s)")
PY
promtool check rules "$scratch/panels.yml"
