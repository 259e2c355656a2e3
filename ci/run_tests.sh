#!/usr/bin/env bash
# Creates a fresh virtualenv, installs the project with its test extra, and runs the README's
# test command. Used by .ci/run; works the same by hand from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-$(mktemp -d)/venv}"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q ".[test]"
"$VENV/bin/python" -m ruff check tvm_hybrid tests tutorials python
# The README's test command:
"$VENV/bin/python" -m pytest -q
