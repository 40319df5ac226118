#!/usr/bin/env bash
# The test command (CI runs exactly this): set-up, lint, then the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests
.venv/bin/python -m pytest "$@"
