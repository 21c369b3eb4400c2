#!/usr/bin/env bash
# Installs what the console's browser test (tests/e2e/tests/it/console_browser.rs, driving
# tests/browser/console.mjs) needs: Debian's Chromium (package chromium, as root, when
# /usr/bin/chromium is missing) and the npm packages of tests/browser (playwright-core, pointed
# at that browser, and @axe-core/playwright; package-lock.json) into tests/browser/node_modules.
# No browser is downloaded from anywhere else. Prints nothing when everything is already there.
# scripts/test.sh runs it and names the browser to the test (NUDGE_TEST_CHROMIUM).
set -euo pipefail
cd "$(dirname "$0")/.."
chromium=${NUDGE_TEST_CHROMIUM:-/usr/bin/chromium}
if [[ ! -x $chromium ]]; then
  [[ $(id -u) -eq 0 ]] || { echo "browser.sh: $chromium is missing; install Debian's chromium (apt-get install chromium)" >&2; exit 1; }
  echo "browser.sh: installing Debian's chromium" >&2
  log=$(mktemp)
  if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core; } >"$log" 2>&1; then
    tail -n 5 "$log" >&2
    rm -f "$log"
    echo "browser.sh: installing chromium failed" >&2
    exit 1
  fi
  rm -f "$log"
fi
command -v node >/dev/null || { echo "browser.sh: node not found (Debian: apt-get install nodejs npm)" >&2; exit 1; }
if [[ ! -d tests/browser/node_modules/playwright-core || ! -d tests/browser/node_modules/@axe-core/playwright ]]; then
  echo "browser.sh: installing tests/browser's packages from the npm registry" >&2
  PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --prefix tests/browser --no-audit --no-fund --loglevel=error
fi
