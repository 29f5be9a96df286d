#!/usr/bin/env bash
# The whole test suite: lint (ruff), layer contracts (import-linter), types (mypy on src/), then pytest.
# `--fast` first: the same checks, then only the unit tests (no process started, none slow).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FAST=0
if [ "${1:-}" = "--fast" ]; then
    FAST=1
    shift
fi
source "$ROOT/scripts/venv.sh"
cd "$ROOT"
ruff check src tests examples benchmarks
ruff format --check src tests examples benchmarks
lint-imports --config pyproject.toml
mypy
if [ "$FAST" = 1 ]; then
    SPREAD_TEST_FAST=1 exec python -m pytest -m "not processes and not slow" "$@"
fi
exec python -m pytest "$@"
