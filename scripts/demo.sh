#!/usr/bin/env bash
# The demo: train a digits classifier on 2 local workers with MultiWorkerMirroredStrategy.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
cd "$ROOT"
exec spread run -n 2 examples/digits.py "$@"
