#!/usr/bin/env bash
# The test command: brings up PostgreSQL and RabbitMQ if they are not answering, then runs every
# test in the workspace against them. Tests that need the database create a fresh database each
# (DATABASE_URL names the server they connect to for that). Nothing is skipped for lack of a
# service: if one cannot be reached, this fails.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/services.sh

export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
export NUDGE_TEST_AMQP_URL=${NUDGE_TEST_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}

# The client examples (clients/) run in the end-to-end tests with their packages from PyPI and npm.
scripts/clients.sh
export NUDGE_TEST_PYTHON=${NUDGE_TEST_PYTHON:-${NUDGE_TEST_CLIENTS_VENV:-$HOME/.cache/nudge/clients-venv}/bin/python}
export NUDGE_TEST_NODE=${NUDGE_TEST_NODE:-$(command -v node)}
# The console's browser test drives Debian's Chromium with playwright-core (tests/browser).
scripts/browser.sh
export NUDGE_TEST_CHROMIUM=${NUDGE_TEST_CHROMIUM:-/usr/bin/chromium}

# The end-to-end tests (tests/e2e) start the real binaries as separate processes: build them.
cargo build --workspace --bins --locked
cargo test --workspace --locked "$@"
