#!/usr/bin/env bash
# The test command (the README and .ci/run both call this): environment, lint, type check, then the whole suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup-env.sh"
cd "$ROOT"
VENV="${MILES_VENV:-$ROOT/.venv}"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/mypy"  # the torch-free modules listed in pyproject.toml's [tool.mypy]
# pytest exits 5 when it collected no test: that is a failure here, as any non-zero code is.
exec "$VENV/bin/python" -m pytest "$@"
