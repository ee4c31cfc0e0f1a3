"""LoRA RL (issue 40): a job with train.lora pushes the adapter to the hf engine, which applies it; the job spec
refuses what cannot take an adapter before anything starts; a LoRA job's checkpoint exports as PEFT's folder or as
the merged model; SGLang generates with the merged weights (sync.lora: merge)."""

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_control.spec.config import JobSpec
from miles_control.testing.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages" / "miles-train" / "tests"))
from backend_rank import contract_batch  # noqa: E402

SMALL = ["rollout.num_prompts_per_step=16", "rollout.eval.num_prompts=50", "rollout.eval.every_steps=2"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"rollout": {"engine": {"type": "sglang"}}, "sync": {"transport": "disk", "delta": True}},
            r"sync.delta with sync.lora: adapter on the sglang engine",
        ),
        ({"sync": {"transport": "p2p"}}, r"train.lora with sync.transport: p2p"),
        ({"sync": {"transport": "disk", "quantization": "int4"}}, r"sync.quantization: int4 with sync.lora: adapter"),
        ({"train": {"backend": "megatron", "lora": {}}}, r"train.lora: backend megatron cannot train an adapter"),
    ],
)
def test_a_lora_job_an_engine_or_transport_cannot_serve_is_refused_before_it_starts(overrides, message):
    spec = {"name": "lora", "rollout": {"engine": {"type": "hf"}}, "train": {"lora": {}}}
    for section, fields in overrides.items():
        spec[section] = {**spec.get(section, {}), **fields}
    with pytest.raises(ValueError, match=message):
        JobSpec.model_validate(spec)
    if "sglang" in str(overrides):  # a whole adapter, or merged weights (a full model, pushed as deltas)
        JobSpec.model_validate({**spec, "sync": {"transport": "disk"}})
        JobSpec.model_validate({**spec, "sync": {"transport": "disk", "delta": True, "lora": "merge"}})


def test_the_hf_engine_applies_a_pushed_adapter_as_the_merged_model_computes(tmp_path):
    """The trainer's adapter push (a fraction of the bytes) gives the engine the policy that the merged push gives
    an engine without one; the weight check compares the adapter; the base alone computes something else."""
    from miles_control.testing.tiny_models import save_tiny_model, tiny_model
    from miles_rollout import GenerateRequest, SamplingParams, build_engine
    from miles_rollout.config import HFEngineConfig
    from miles_sync import DiskSync, build_sender
    from miles_train import TrainConfig, build_backend

    model = save_tiny_model(tmp_path / "m", tiny_model("qwen2", eos_token_id=1, pad_token_id=0), seed=0)
    config = TrainConfig.model_validate({"lora": {"rank": 4, "alpha": 8}, "optimizer": {"lr": 0.05}})
    backend = build_backend(config, model, 0, 1, f"tcp://127.0.0.1:{free_port()}")
    sender = build_sender(DiskSync(dir=str(tmp_path / "w")).for_engines("float32"))
    try:
        for _ in range(3):
            backend.train_step(contract_batch())
        adapter_push = sender.publish(backend.export_weights(), weight_version=3)
        backend.set_lora_push("merge")
        merged_push = sender.publish(backend.export_weights(), weight_version=4)
    finally:
        sender.close()
        backend.shutdown()
    with_adapter = build_engine(HFEngineConfig(type="hf"), model, lora=config.lora.peft_kwargs())
    merged, base = build_engine(HFEngineConfig(type="hf"), model), build_engine(HFEngineConfig(type="hf"), model)
    assert with_adapter.receive(adapter_push) == adapter_push.fingerprint
    assert merged.receive(merged_push) == merged_push.fingerprint
    assert with_adapter.weight_version == 3
    assert adapter_push.num_tensors == 2 * 7 * 2  # A and B of 7 projections in each of 2 layers
    assert adapter_push.num_bytes < merged_push.num_bytes
    with pytest.raises(ValueError, match="lacks .* parameter"):  # a full push is not an adapter
        with_adapter.receive(merged_push)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=1)
    requests = [GenerateRequest(ids, sampling, request_id=str(i)) for i, ids in enumerate(([5, 6, 7], [8, 9]))]

    def first_logits(engine):
        with torch.no_grad():
            return engine.model(input_ids=torch.tensor([requests[0].input_ids])).logits[0, -1]

    torch.testing.assert_close(first_logits(with_adapter), first_logits(merged), rtol=1e-5, atol=1e-5)
    assert float((first_logits(with_adapter) - first_logits(base)).abs().max()) > 1e-3  # the adapter did something
    assert all(r.output_ids for r in asyncio.run(with_adapter.generate(requests)))


def run_job(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, str]:
    url = f"sqlite:///{tmp_path}/miles.db"
    args = [
        sys.executable,
        "-m",
        "miles_control.cli.main",
        "run",
        str(ROOT / "examples" / "arithmetic.yaml"),
        "--quiet",
    ]
    for o in (f"store.url={url}", f"output_dir={tmp_path}/runs", *SMALL, *overrides):
        args += ["--set", o]
    result = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    return result, url


def check_exports(tmp_path: Path, url: str, model: Path) -> None:
    """`miles export` of the job's final checkpoint: the adapter (PEFT's folder, with the tokenizer) and, with
    --merged, the merged model; PEFT's merge of the one computes what the other does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_out, merged_out = tmp_path / "adapter", tmp_path / "merged"
    cli = [sys.executable, "-m", "miles_control.cli.main", "export", "1"]
    for out, extra in ((adapter_out, []), (merged_out, ["--merged"])):
        done = subprocess.run([*cli, str(out), "--store", url, *extra], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr + done.stdout
    assert (adapter_out / "adapter_model.safetensors").is_file() and (adapter_out / "tokenizer_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(adapter_out)).merge_and_unload()
    merged = AutoModelForCausalLM.from_pretrained(str(merged_out), dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(peft(ids).logits, merged(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("backend", ["fsdp2", "torchtitan"])
def test_a_lora_job_pushes_the_adapter_to_the_hf_engine_and_exports_it(tmp_path, backend):
    from transformers import AutoModelForCausalLM

    from miles_control.service.store import Store

    _, url = run_job(
        tmp_path, "rollout.engine.type=hf", "train.lora={rank: 8, alpha: 16}", "schedule.type=one_step_off",
        "schedule.num_steps=3", "schedule.save_final=true", f"train.backend.type={backend}",
    )  # fmt: skip
    store = Store(url)
    job = store.job(1)
    assert job.status == "succeeded", job.error
    pushes = store.spans(1, "weight_sync")
    assert len(pushes) == 3
    assert all(p.attrs["trainer_fingerprint"] == p.attrs["engine_fingerprint"] for p in pushes)
    model = Path(next(e.data["path"] for e in store.events(1) if e.kind == "model"))
    base = AutoModelForCausalLM.from_pretrained(str(model))
    full_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    assert all(0 < p.num_bytes < 0.5 * full_bytes for p in pushes), [p.num_bytes for p in pushes]

    check_exports(tmp_path, url, model)


@pytest.mark.slow
@pytest.mark.sglang
def test_sglang_serves_each_pushed_adapter_by_name_without_pausing(tmp_path):
    """sync.lora: adapter on SGLang: each push is loaded into the servers under its version's name, the calls after
    it name it, the servers never pause; the engine computes the trainer's logprobs; old adapters are unloaded."""
    pytest.importorskip("sglang", reason="SGLang is not installed")
    from miles_control.service.store import Store

    logs = tmp_path / "sglang-logs"
    _, url = run_job(
        tmp_path, "rollout.engine.type=sglang", f"rollout.engine.log_dir={logs}", "train.lora={rank: 8, alpha: 16}",
        "schedule.num_steps=3", "schedule.save_final=true",
    )  # fmt: skip
    store = Store(url)
    assert store.job(1).status == "succeeded", store.job(1).error
    pushes = store.spans(1, "weight_sync")
    assert len(pushes) == 3 and all(p.attrs["trainer_fingerprint"] == p.attrs["engine_fingerprint"] for p in pushes)
    for push in pushes:
        phases = push.attrs["phases"]
        assert {"load/write", "load/servers"} <= set(phases), phases  # written as PEFT's folder, loaded by name
        assert phases["pause/servers"] < 0.05, phases  # new calls wait for the load; running ones go on
    # every step after the first generates under the adapter just pushed: the trainer's logprobs are the engine's
    diffs = dict(store.metric_series(1, "train/logprob_diff"))
    assert len(diffs) == 3 and all(d < 1e-5 for d in diffs.values()), diffs
    log = (logs / "sglang-0.log").read_text()
    for version in (1, 2, 3):
        assert f"lora_name=miles-v{version}" in log, version
    assert re.search(r"unloading completes: LoRARef\(lora_id=\w+, lora_name=miles-v1\)", log)  # gone once v3 came
    check_exports(tmp_path, url, Path(next(e.data["path"] for e in store.events(1) if e.kind == "model")))


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.extended
def test_sglang_generates_with_the_merged_weights_of_a_lora_job(tmp_path):
    """sync.lora: merge: each push is the merged model, loaded and checked (every server's checksums) as a full
    push is; the trainer computes the engine's logprobs."""
    pytest.importorskip("sglang", reason="SGLang is not installed")
    from miles_control.service.store import Store

    _, url = run_job(
        tmp_path, "rollout.engine.type=sglang", "train.lora={rank: 8, alpha: 16}", "sync.lora=merge",
        "schedule.num_steps=2",
    )  # fmt: skip
    store = Store(url)
    assert store.job(1).status == "succeeded", store.job(1).error
    pushes = store.spans(1, "weight_sync")
    assert len(pushes) == 2 and all(p.attrs["trainer_fingerprint"] == p.attrs["engine_fingerprint"] for p in pushes)
    diffs = dict(store.metric_series(1, "train/logprob_diff"))
    assert len(diffs) == 2 and all(d < 1e-5 for d in diffs.values()), diffs
