#!/usr/bin/env bash
# Checks that every error is logged the one way docs/OBSERVABILITY.md ("Logging an error")
# describes: `error.cause_chain = %error_chain(&e)` (`%error_chain(&*e)` for an anyhow::Error),
# with the one `nudge_telemetry::error_chain`. Reads the crates' and tests' `src` directories
# (not their tests/), offline, in well under a second. Exits 1 naming file:line for:
#   - `error.cause_chain` set to anything but `%error_chain(...)` (`?e`, `%e`, `%format!(..)`);
#   - a field named `error` or `err` (`error = %e`, `error = ?e`, `err = ...`);
#   - `?e`, `%e`, `?err`, `%error`... (an error's Debug or Display as a field of its own);
#   - `{e}`, `{err:?}`, `{:#}`... in a log message (an error formatted into the text);
#   - `#[instrument(err)]` (logs the error by its Display or Debug);
#   - a definition of `fn error_chain` other than crates/telemetry/src/lib.rs.
# Only the inside of tracing's macros (trace!, debug!, info!, warn!, error!, event!, span!,
# *_span!) is read, from the macro's name to its closing parenthesis, so `let err = ...`
# elsewhere is not a log. Usage: scripts/check-logging.sh [ROOT] (default: the repository).
set -euo pipefail
root=${1:-"$(dirname "$0")/.."}
cd "$root"

mapfile -t files < <(find crates tests -type f -name '*.rs' -path '*/src/*' -not -path '*/target/*' | sort)
if ((${#files[@]} == 0)); then
  echo "check-logging: no Rust sources under crates/*/src or tests/*/src" >&2
  exit 1
fi

# Each line inside a tracing macro as "file:line:text", text once with string literals blanked
# (for fields) and once as written (for format strings).
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
awk -v code_out="$scratch/code" -v text_out="$scratch/text" '
  function is_ident(ch) { return ch ~ /[A-Za-z0-9_]/ }
  FNR == 1 { depth = 0; instr = 0 }
  {
    line = $0
    if (depth == 0 && index(line, "!") == 0) next
    n = length(line); code = ""; seen = (depth > 0); i = 1
    while (i <= n) {
      c = substr(line, i, 1)
      if (instr) {                      # inside a string literal: blanked
        if (c == "\\") { code = code "  "; i += 2; continue }
        if (c == "\"") { instr = 0; code = code c } else code = code " "
        i++; continue
      }
      if (c == "\"") { instr = 1; code = code c; i++; continue }
      if (c == "/" && substr(line, i + 1, 1) == "/") break
      if (c == "\047") {                # a char literal such as ( or \n in quotes
        if (substr(line, i + 1, 1) == "\\") {
          j = index(substr(line, i + 2), "\047")
          if (j) { code = code "\047\047"; i += 2 + j; continue }
        } else if (substr(line, i + 2, 1) == "\047") { code = code "\047\047"; i += 3; continue }
      }
      if (depth == 0 && c ~ /[a-z]/ && (i == 1 || !is_ident(substr(line, i - 1, 1)))) {
        rest = substr(line, i)
        if (match(rest, /^[a-z_]+[ \t]*![ \t]*[(]/)) {
          name = rest; sub(/[ \t]*!.*/, "", name)
          if (name ~ /^(trace|debug|info|warn|error|event|span|[a-z]+_span)$/) {
            seen = 1
            code = code substr(rest, 1, RLENGTH - 1)
            i += RLENGTH - 1
            depth = 1; code = code "("; i++
            continue
          }
        }
        while (i <= n && is_ident(substr(line, i, 1))) { code = code substr(line, i, 1); i++ }
        continue
      }
      if (depth > 0) {
        if (c == "(") depth++
        else if (c == ")") depth--
      }
      code = code c
      i++
    }
    if (depth == 0) instr = 0
    if (seen) {
      print FILENAME ":" FNR ":" code > code_out
      print FILENAME ":" FNR ":" line > text_out
    }
  }
' "${files[@]}"
touch "$scratch/code" "$scratch/text"

report() { # $1: what is wrong; stdin: file:line:text
  local file line _
  while IFS=: read -r file line _; do
    printf '%s:%s: %s\n' "$file" "$line" "$1"
  done >>"$scratch/found"
}

# `error.cause_chain` takes `%error_chain(...)` and nothing else.
report 'error.cause_chain must be `%error_chain(&e)` (or `%error_chain(&*e)` for anyhow)' < <(
  grep -E 'cause_chain[[:space:]]*=' "$scratch/code" |
    grep -vE 'cause_chain[[:space:]]*=[[:space:]]*%[[:space:]]*(nudge_telemetry::)?error_chain[[:space:]]*\(' || true)

# No field named `error` or `err` (the field is `error.cause_chain`).
report 'a field named `error`/`err`: log `error.cause_chain = %error_chain(&e)`' < <(
  grep -E '(^[^:]*:[0-9]+:|[^A-Za-z0-9_.])(error|err)[[:space:]]*=[^=]' "$scratch/code" || true)

# No error as a field by its Debug or Display (`?e`, `%err`, `%e.without_url()`, ...).
report 'an error logged by `?`/`%`: log `error.cause_chain = %error_chain(&e)`' < <(
  grep -E '[?%][[:space:]]*(e|err|error|source|cause)([^A-Za-z0-9_]|$)' "$scratch/code" || true)

# No error formatted into the message, and no `{:#}` (an anyhow chain by hand) in a log.
report 'an error formatted into a log message: log `error.cause_chain = %error_chain(&e)`' < <(
  grep -E '\{(e|err|error)(:[^}]*)?\}|\{[A-Za-z0-9_]*:#\??\}' "$scratch/text" || true)

# `#[instrument(err)]` logs the error by its Display (or Debug) under a field of its own.
report '#[instrument(err)]: log the error where it is handled with error_chain' < <(
  grep -nE '#\[(tracing::)?instrument\(.*\berr\b' "${files[@]}" || true)

# One implementation of the chain.
report 'a second `fn error_chain`: use nudge_telemetry::error_chain' < <(
  grep -nE '\bfn[[:space:]]+error_chain\b' "${files[@]}" | grep -v '^crates/telemetry/src/lib.rs:' || true)

if [[ -s $scratch/found ]]; then
  sort -t: -k1,1 -k2,2n -s "$scratch/found"
  echo "check-logging: log an error as \`error.cause_chain = %error_chain(&e)\`" \
    "(docs/OBSERVABILITY.md, \"Logging an error\")" >&2
  exit 1
fi
echo "check-logging: ${#files[@]} files, every error logged through error_chain"
