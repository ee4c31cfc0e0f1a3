#!/usr/bin/env bash
# The demo: create the environment if needed, then run GRPO on arithmetic (sync schedule, local Ray,
# SQLite, SGLang on CPU where installed, else the in-process engine). Extra arguments go to `miles run`, e.g. --set schedule.num_steps=50.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup-env.sh"
cd "$ROOT"
exec "${MILES_VENV:-$ROOT/.venv}/bin/miles" run examples/arithmetic.yaml "$@"
