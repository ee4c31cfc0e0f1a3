"""Rollout routing replay on a mixture of experts (issue 41): the engine (SGLang, or the hf engine reading
transformers' routers) returns the experts each token was routed to,
the samples carry them to the trainer, and with `train.routing_replay` the trainer's routers take them; the job
reports how often the trainer's own routing agreed with the engine's (`train/routing_agreement`). The job runs on
megatron with its experts split over two ranks (expert parallel), and on fsdp2."""

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_control.spec.config import JobSpec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from model_matrix import TOY_PROMPTS, build_model  # noqa: E402


@pytest.mark.parametrize("engine", ["hf", "sglang"])
def test_replay_asks_the_engine_for_its_routing(engine):
    spec = JobSpec.model_validate(
        {"name": "r", "rollout": {"engine": {"type": engine}}, "train": {"routing_replay": True}}
    )
    assert spec.rollout.engine.routed_experts  # the servers (or the in-process engine) are asked for it


def test_the_hf_engine_returns_the_routing_and_a_trainer_replays_it(tmp_path):
    """The hf engine records its routers' choices as it decodes (prefill, then one position per step): for every row,
    prompt + output less the last id, the experts a plain forward of those ids chooses. A trainer replaying them
    (fsdp2, fp32) agrees with them everywhere."""
    from transformers import AutoModelForCausalLM

    from miles_control.bench.inprocess import run_steps
    from miles_rollout import GenerateRequest, HFEngineConfig, SamplingParams, build_engine

    model_dir = build_model("qwen3_moe", "float32", tmp_path / "moe")
    engine = build_engine(HFEngineConfig(routed_experts=True), model_dir, seed=0)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5)
    requests = [GenerateRequest(p, sampling, request_id=str(i)) for i, p in enumerate([[3, 13, 4, 16], [9, 16]])]
    results = asyncio.run(engine.generate(requests))
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    routers = {int(n.split("layers.")[1].split(".")[0]): m for n, m in plain.named_modules() if n.endswith("mlp.gate")}
    chosen: dict[int, torch.Tensor] = {}
    for layer, router in routers.items():
        router.register_forward_hook(lambda m, i, out, layer=layer: chosen.__setitem__(layer, out[2]))
    for request, result in zip(requests, results, strict=True):
        ids = request.input_ids + result.output_ids
        assert result.routed_experts.shape == (len(ids) - 1, len(routers) * 2)  # 2 layers × top 2
        with torch.no_grad():
            plain(input_ids=torch.tensor([ids[:-1]]))
        own = torch.cat([chosen[layer] for layer in sorted(chosen)], dim=-1)
        engine_choice = result.routed_experts.long().view(len(ids) - 1, -1, 2).sort(-1).values
        assert torch.equal(engine_choice, own.view(len(ids) - 1, -1, 2).sort(-1).values)

    train = {"backend": "fsdp2", "optimizer": {"lr": 1e-3}, "routing_replay": True}
    steps = run_steps(engine, model_dir, "float32", train, TOY_PROMPTS, num_steps=2)
    assert all(step["weights_match"] for step in steps)
    assert [step["train/routing_agreement"] for step in steps] == [1.0, 1.0]  # fp32: the same choices
    engine.shutdown()


def test_replay_on_a_dense_model_is_refused_before_the_job_starts(tmp_path):
    from miles_control.job.preflight import JobCheckError, check_job

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
    from miles_control.service.store import Store

    model = build_model("qwen3_moe", "bfloat16", tmp_path / "moe")
    url = f"sqlite:///{tmp_path}/miles.db"
    args = [
        sys.executable,
        "-m",
        "miles_control.cli.main",
        "run",
        str(ROOT / "examples" / "arithmetic.yaml"),
        "--quiet",
    ]
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


def test_replay_on_a_mixture_of_experts_with_dense_layers(tmp_path):
    """Issue 55: a Qwen3-MoE whose first layer is dense (`mlp_only_layers: [0]`): the hf engine packs the routing of
    the layers that have experts, and the trainer read it by absolute layer number, so layer 1's router got what
    belonged to no layer, and the job failed mid-run. Layers are now matched by position: the replay agrees
    everywhere in fp32."""
    from miles_control.bench.inprocess import run_steps
    from miles_rollout import HFEngineConfig, build_engine
    from miles_train.routing import routing_columns

    model_dir = build_model("qwen3_moe", "float32", tmp_path / "moe", mlp_only_layers=[0])
    engine = build_engine(HFEngineConfig(routed_experts=True), model_dir, seed=0)
    train = {"backend": "fsdp2", "optimizer": {"lr": 1e-3}, "routing_replay": True}
    steps = run_steps(engine, model_dir, "float32", train, TOY_PROMPTS, num_steps=2)
    engine.shutdown()
    assert [step["train/routing_agreement"] for step in steps] == [1.0, 1.0]
    assert routing_columns([1, 3], 2) == {1: 0, 3: 1} and routing_columns([1, 3], 4) == {1: 1, 3: 3}
    with pytest.raises(ValueError, match=r"the engine's routing has 3 layers; the model has routers in layers"):
        routing_columns([1, 3], 3)


def test_deepseek_v3_on_the_hf_engine_and_fsdp2_with_replay(tmp_path):
    """Issue 55, item 2: a tiny DeepSeek-V3 (multi-head latent attention, a dense first layer, routed experts with
    sigmoid scores, a score-correction bias buffer and a shared expert) failed at its first push (the bias buffer was
    unknown to the hf engine), and its router (`DeepseekV3TopkRouter`) was not found by class name, so replay did
    nothing. Pushes now carry the buffer with the weight check on, and the router, found by what it holds, replays
    the engine's experts weighed as it weighs its own."""
    from miles_control.bench.inprocess import run_steps
    from miles_rollout import HFEngineConfig, build_engine

    model_dir = build_model("deepseek_v3", "float32", tmp_path / "dsv3")
    engine = build_engine(HFEngineConfig(routed_experts=True), model_dir, seed=0)
    train = {"backend": "fsdp2", "optimizer": {"lr": 1e-3}, "routing_replay": True}
    steps = run_steps(engine, model_dir, "float32", train, TOY_PROMPTS, num_steps=2)
    engine.shutdown()
    assert all(step["weights_match"] for step in steps)
    assert [step["train/routing_agreement"] for step in steps] == [1.0, 1.0]
