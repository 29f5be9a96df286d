#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv with the pinned dependencies; prints nothing on reuse.
# Sourced by demo.sh and test.sh so a fresh machine needs nothing installed by hand.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPREAD_VENV:-$ROOT/.venv}"
STAMP="$VENV/.spread-lock-$(sha256sum "$ROOT/requirements-lock.txt" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
    echo "setting up $VENV (pinned dependencies from requirements-lock.txt)" >&2
    python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$ROOT/requirements-lock.txt"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e "$ROOT"
    rm -f "$VENV"/.spread-lock-*
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
