#!/usr/bin/env bash
# The whole test suite: lint (ruff), layer contracts (import-linter), types (mypy on src/), then pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
cd "$ROOT"
ruff check src tests examples benchmarks
ruff format --check src tests examples benchmarks
lint-imports --config pyproject.toml
mypy
exec python -m pytest "$@"
