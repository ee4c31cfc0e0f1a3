"""The built-in model's warm start reaches its accuracy target whatever kernels the CPU runs: a fixed step count
gave 0.27 held-out accuracy on the AVX2 path and 0.37 on AVX-512 (a new machine saw 0.13)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

BUILD = """
import json, sys
from pathlib import Path
from miles_control.job.assets import build_builtin_model
from miles_control.spec.config import BuiltinModelConfig
folder = build_builtin_model(BuiltinModelConfig(), root=Path(sys.argv[1]))
print(json.dumps(json.loads((folder / "miles_asset.json").read_text())))
"""


# `default` (the oldest kernels) is the extended tier: AVX2 is the path that missed the target before.
@pytest.mark.parametrize("capability", ["avx2", pytest.param("default", marks=pytest.mark.extended)])
def test_the_warm_start_reaches_its_target_on_other_cpu_kernels(tmp_path, capability):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}  # torch's kernels of an older or another CPU
    out = subprocess.run([sys.executable, "-c", BUILD, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=600, check=True).stdout  # fmt: skip
    asset = json.loads(out.strip().splitlines()[-1])
    target = asset["config"]["warm_start_target"]
    assert asset["warm_start_accuracy"] >= target, asset
    assert asset["warm_start_steps_done"] < asset["config"]["warm_start_steps"], asset  # stopped by the target
