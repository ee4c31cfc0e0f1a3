#!/usr/bin/env bash
# The GPU paths, checked on a machine with an NVIDIA GPU: each check runs, its result and time are printed,
# and a summary at the end says what passed (exit code 1 if anything failed). About 15–25 minutes on one GPU.
#
#   bash scripts/gpu-check.sh                # every check
#   bash scripts/gpu-check.sh demo parity    # some of them: demo packed colocated parity bench
#
# It uses its own virtual environment (MILES_VENV, default .venv-cuda): the pinned stack plus SGLang's CUDA
# dependencies (sgl-kernel, flashinfer), which the CPU environment leaves out. Logs: $OUT (default
# .miles/gpu-check/). Not run yet on a GPU: docs/deployment.md records what was.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export MILES_VENV="${MILES_VENV:-$ROOT/.venv-cuda}"
OUT="${OUT:-$ROOT/.miles/gpu-check}"
mkdir -p "$OUT"

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU here (nvidia-smi finds none); nothing to check" >&2
  exit 2
fi
nvidia-smi -L

bash scripts/setup-env.sh || { echo "gpu-check: environment set-up failed" >&2; exit 2; }
PY="$MILES_VENV/bin/python"
MILES="$MILES_VENV/bin/miles"
if ! "$PY" -c "import sgl_kernel, torch; assert torch.cuda.is_available()" 2>/dev/null; then
  echo "[gpu-check] installing SGLang's CUDA dependencies into $MILES_VENV" >&2
  "$PY" -m pip install -q "sglang==0.5.23" || { echo "gpu-check: could not install sglang's CUDA kernels" >&2; exit 2; }
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

GPUS="$("$PY" -c "import torch; print(torch.cuda.device_count())")"
SGLANG=(--set rollout.engine.type=sglang --set "rollout.engine.log_dir=$OUT/sglang")
# fp8_block needs 128×128 blocks in every linear layer: the built-in model at hidden 256 with 4 KV heads.
BLOCKS=(--set model.hidden_size=256 --set model.num_heads=4 --set model.num_kv_heads=4)

declare -A RESULT SECONDS_TAKEN
ORDER=()
check() {  # check NAME command...
  local name="$1"; shift
  ORDER+=("$name")
  echo; echo "=== $name: $*"
  local start=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then RESULT[$name]=PASS; else RESULT[$name]="FAIL (log: $OUT/$name.log)"; fi
  SECONDS_TAKEN[$name]=$((SECONDS - start))
  tail -n 15 "$OUT/$name.log"
  echo "=== $name: ${RESULT[$name]} in ${SECONDS_TAKEN[$name]} s"
}

want() { [[ $# -eq 0 || " $SELECTED " == *" $1 "* ]]; }
SELECTED="${*:-demo packed colocated parity bench}"

if want demo; then
  # the demo on SGLang with GPU placement (resources: auto gives each trainer rank and the engine a GPU)
  check demo "$MILES" run examples/arithmetic.yaml "${SGLANG[@]}" --set schedule.num_steps=60 --log-every 10
fi
if want packed; then
  # packed fp8_block pushes into SGLang's block-FP8 kernels, over CUDA-resident tensor handles
  check packed "$MILES" run examples/quick.yaml "${SGLANG[@]}" "${BLOCKS[@]}" --set sync.transport=tensor \
    --set sync.quantization=fp8_block --set sync.quant_wire=packed --set train.quantization=fp8_block \
    --set schedule.num_steps=10 --log-every 2
fi
if want colocated; then
  if (( GPUS >= 1 )); then
    check colocated "$MILES" run examples/quick.yaml "${SGLANG[@]}" --set resources.mode=colocated \
      --set sync.transport=tensor --set schedule.num_steps=10 --log-every 2
  fi
fi
if want parity; then
  check parity "$PY" -m pytest -q -p no:cacheprovider tests/test_logprob_parity.py tests/test_sampling_parity.py \
    packages/miles-train/tests/test_backend_contract.py
fi
if want bench; then
  check bench "$PY" bench/weight_update.py --quick
fi

echo; echo "gpu-check summary ($(date -u +%FT%TZ), $GPUS GPU(s)):"
failed=0
for name in "${ORDER[@]}"; do
  printf '  %-10s %-60s %5s s\n' "$name" "${RESULT[$name]}" "${SECONDS_TAKEN[$name]}"
  [[ "${RESULT[$name]}" == PASS ]] || failed=1
done
exit $failed
