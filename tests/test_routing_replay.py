"""Rollout routing replay on a mixture of experts (issue 41): SGLang returns the experts each token was routed to,
the samples carry them to the trainer, and with `train.routing_replay` the trainer's routers take them; the job
reports how often the trainer's own routing agreed with the engine's (`train/routing_agreement`). The job runs on
megatron with its experts split over two ranks (expert parallel), and on fsdp2."""

import subprocess
import sys
from pathlib import Path

import pytest

from miles_control.config import JobSpec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from model_matrix import build_model  # noqa: E402


def test_replay_needs_an_engine_that_returns_its_routing():
    with pytest.raises(ValueError, match="train.routing_replay .* the hf engine does not return"):
        JobSpec.model_validate({"name": "r", "rollout": {"engine": {"type": "hf"}}, "train": {"routing_replay": True}})
    spec = JobSpec.model_validate(
        {"name": "r", "rollout": {"engine": {"type": "sglang"}}, "train": {"routing_replay": True}}
    )
    assert spec.rollout.engine.routed_experts  # the servers are asked for it


def test_replay_on_a_dense_model_is_refused_before_the_job_starts(tmp_path):
    from miles_control.preflight import JobCheckError, check_job

    dense = build_model("qwen3", "float32", tmp_path / "dense")
    spec = JobSpec.model_validate(
        {"name": "r", "rollout": {"engine": {"type": "sglang"}}, "train": {"routing_replay": True}}
    )
    with pytest.raises(JobCheckError, match=r"train.routing_replay: model .* is not a mixture of experts"):
        check_job(spec, dense)


# megatron with the experts over two ranks in the default tier; fsdp2 (transformers' own MoE modules, whose
# replay the unit tests in packages/miles-train/tests/test_routing.py cover) as a repeat in the extended tier
BACKENDS = [
    pytest.param("{type: megatron, world_size: 2, expert_parallel_size: 2}", id="megatron-ep2"),
    pytest.param("fsdp2", id="fsdp2", marks=pytest.mark.extended),
]


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_job_replays_sglangs_routing_in_the_trainer(backend, tmp_path):
    pytest.importorskip("sglang", reason="SGLang is not installed")
    from miles_control.store import Store

    model = build_model("qwen3_moe", "bfloat16", tmp_path / "moe")
    url = f"sqlite:///{tmp_path}/miles.db"
    args = [sys.executable, "-m", "miles_control.cli", "run", str(ROOT / "examples" / "arithmetic.yaml"), "--quiet"]
    for o in (
        f"store.url={url}", f"output_dir={tmp_path}/runs", f"model={{source: path, path: {model}}}",
        "rollout.engine.type=sglang", "train.routing_replay=true", "schedule.num_steps=2",
        "rollout.num_prompts_per_step=16", "rollout.eval.every_steps=0", f"train.backend={backend}",
    ):  # fmt: skip
        args += ["--set", o]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    store = Store(url)
    assert store.job(1).status == "succeeded", store.job(1).error
    pushes = store.spans(1, "weight_sync")  # the per-expert checkpoint tensors, checked against SGLang's stacks
    assert len(pushes) == 2 and all(p.attrs["trainer_fingerprint"] == p.attrs["engine_fingerprint"] for p in pushes)
    agreement = dict(store.metric_series(1, "train/routing_agreement"))
    assert set(agreement) == {1, 2}
    assert all(0.9 < a <= 1.0 for a in agreement.values()), agreement  # bf16: a near-tie may fall either way
    diffs = dict(store.metric_series(1, "train/logprob_diff"))
    assert all(d < 0.02 for d in diffs.values()), diffs  # the dense bf16 bound (tests/test_model_matrix.py)
