#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with the pinned CPU stack, the four packages
# and the dashboard app installed editable. Idempotent: a stamp of the pin files skips work when nothing changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MILES_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3

stamp_of() {
  cat "$ROOT"/requirements/*.txt "$ROOT"/packages/*/pyproject.toml "$ROOT"/apps/*/pyproject.toml | sha256sum | cut -c1-16
}
STAMP="$(stamp_of)"
if [[ -x "$VENV/bin/python" && -f "$VENV/.miles-stamp" && "$(cat "$VENV/.miles-stamp")" == "$STAMP" ]]; then
  exit 0
fi

echo "[miles] setting up $VENV (pinned stack: ~7 GB, a few minutes the first time)" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# Step 1: the stack with its dependencies (torch comes from the local wheel mirror, pinned).
"${PIP[@]}" install -r "$ROOT/requirements/cpu.txt" -r "$ROOT/requirements/dev.txt" 2> >(grep -v "is ignored: it is neither" >&2)
# Step 2: packages whose metadata would drag in CUDA-only extras or that declare Python ≥ 3.12.
"${PIP[@]}" install --no-deps --ignore-requires-python -r "$ROOT/requirements/cpu-nodeps.txt" 2> >(grep -v "is ignored: it is neither" >&2)
# Step 3: the hubs' environment packages (verifiers, OpenEnv) and what they import, pinned, without their metadata's
# dependencies, which would move pins of step 1 (requirements/hubs-nodeps.txt says which and why).
"${PIP[@]}" install --no-deps -r "$ROOT/requirements/hubs-nodeps.txt" 2> >(grep -v "is ignored: it is neither" >&2)
# Step 4: Miles itself (the packages and apps/dashboard), editable, without touching the pins above.
"${PIP[@]}" install --no-deps --no-build-isolation \
  -e "$ROOT/packages/miles-sync" -e "$ROOT/packages/miles-rollout" \
  -e "$ROOT/packages/miles-train" -e "$ROOT/packages/miles-control" -e "$ROOT/apps/dashboard" 2> >(grep -v "is ignored: it is neither" >&2)
echo "$STAMP" > "$VENV/.miles-stamp"
echo "[miles] environment ready: $VENV" >&2
