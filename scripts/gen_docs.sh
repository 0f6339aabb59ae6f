#!/usr/bin/env bash
# Regenerate docs/commands.md, the command reference, from the CLI itself (typer's `utils docs`),
# so that it cannot drift from `--help`. tests/test_docs.py fails when the committed file is stale.
#
#   bash scripts/gen_docs.sh [OUTPUT]    default OUTPUT: docs/commands.md
#
# PYTHON picks the interpreter (default: the project's .venv, else python3); it must have
# loader-search installed.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
output="${1:-$root/docs/commands.md}"
case "$output" in /*) ;; *) output="$PWD/$output" ;; esac
python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$root/.venv/bin/python" ]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
generated="$(mktemp)"
trap 'rm -f "$generated"' EXIT
# A fixed width, no colour and no terminal: the same file on every machine.
(cd "$root" && COLUMNS=100 NO_COLOR=1 TERM=dumb "$python" -m typer loader_search.cli._commands \
  utils docs --name loader-search --output "$generated" >/dev/null)
{
  echo "<!-- Generated from the CLI by scripts/gen_docs.sh: do not edit; run it instead. -->"
  echo
  cat "$generated"
} >"$output"
