#!/usr/bin/env bash
# Installs what the client examples in clients/ need, for their tests (tests/e2e, events_push):
# the `standardwebhooks` package from PyPI into a virtualenv (NUDGE_TEST_CLIENTS_VENV, default
# ~/.cache/nudge/clients-venv) and the npm packages of clients/node (package-lock.json) into
# clients/node/node_modules. Prints nothing on success when everything is already there.
# scripts/test.sh runs it and points the tests at the results (NUDGE_TEST_PYTHON,
# NUDGE_TEST_NODE).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${NUDGE_TEST_CLIENTS_VENV:-$HOME/.cache/nudge/clients-venv}
if ! "$venv/bin/python" -c 'import standardwebhooks' 2>/dev/null; then
  echo "clients.sh: installing standardwebhooks from PyPI into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --index-url https://pypi.org/simple -r clients/python/requirements.txt
fi
command -v node >/dev/null || { echo "clients.sh: node not found (Debian: apt-get install nodejs npm)" >&2; exit 1; }
if [[ ! -d clients/node/node_modules/standardwebhooks ]]; then
  echo "clients.sh: installing clients/node's packages from the npm registry" >&2
  npm ci --prefix clients/node --no-audit --no-fund --loglevel=error
fi
