"""LoRA on the fsdp2 and torchtitan backends (train.lora, through PEFT): the base stays frozen, the optimizer holds
the adapter alone, a push sends the adapter under PEFT's names or the merged weights, the merge is PEFT's own, ranks
and backends agree, and a checkpoint (the adapter in PEFT's layout) resumes to the same next step."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_control.testing.servers import free_port
from miles_train import TrainConfig

RANK_SCRIPT = Path(__file__).with_name("lora_rank.py")
TARGETS = ("q_proj", "v_proj")


def run_ranks(model_dir, world_size: int, tmp_path, backend: str = "fsdp2") -> dict:
    out, ckpt = tmp_path / f"lora-{backend}-ws{world_size}.pt", tmp_path / f"ckpt-{backend}-ws{world_size}"
    ports = [str(free_port()), str(free_port())]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(RANK_SCRIPT),
                str(model_dir),
                str(r),
                str(world_size),
                ports[0],
                str(out),
                str(ckpt),
                ports[1],
                backend,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(world_size)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    failed = [f"rank {r}:\n{log[-3000:]}" for r, (p, log) in enumerate(zip(procs, logs, strict=True)) if p.returncode]
    assert not failed, "\n".join(failed)
    return {**torch.load(out, weights_only=False), "ckpt": ckpt}


RUNS = [("fsdp2", 1), ("fsdp2", 2), ("torchtitan", 2)]
ONE_OF_EACH = [("fsdp2", 1), ("torchtitan", 2)]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    return {(backend, n): run_ranks(tiny_model_dir, n, tmp, backend) for backend, n in RUNS}


def checkpoint_weights(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


@pytest.mark.parametrize("which", ONE_OF_EACH, ids=lambda w: f"{w[0]}-x{w[1]}")
def test_only_the_adapter_trains_and_its_push_is_the_adapter_alone(runs, tiny_model_dir, which):
    run = runs[which]
    base = checkpoint_weights(tiny_model_dir)
    assert set(run["merged_before"]) == set(base)
    for name, tensor in run["merged_before"].items():  # B starts at zero: the merged model is the base
        assert torch.equal(tensor, base[name]), name
    adapter = run["adapter_saved"]
    layers = {name.split(".layers.")[1].split(".")[0] for name in base if ".layers." in name}
    assert len(adapter) == 2 * len(TARGETS) * len(layers)  # A and B of each targeted linear of each layer
    assert all(n.startswith("base_model.model.model.layers.") and ".lora_" in n and ".default." not in n
               for n in adapter)  # fmt: skip
    assert all(float(t.abs().max()) > 0 for n, t in adapter.items() if ".lora_B." in n)  # B moved off zero
    moved = {n for n, t in run["merged_saved"].items() if not torch.equal(t, base[n])}
    assert moved and all(n.endswith(tuple(f"{m}.weight" for m in TARGETS)) for n in moved), sorted(moved)
    assert run["optimizer_params"] == len(adapter)  # AdamW state for the adapter's matrices alone
    assert all(m["train/kl"] >= 0 for m in run["metrics"]) and run["metrics"][1]["train/kl"] > 0  # KL to the base


@pytest.mark.parametrize("which", ONE_OF_EACH, ids=lambda w: f"{w[0]}-x{w[1]}")
def test_the_merged_push_is_peft_merge_of_the_saved_adapter(runs, tiny_model_dir, which):
    """The checkpoint's adapter/ is PEFT's layout: PeftModel loads it, and its merge_and_unload equals the
    merged weights a push sends."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = runs[which]
    folder = run["ckpt"] / "adapter"
    assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), str(folder))
    peft_merged = model.merge_and_unload().state_dict()
    for name, tensor in run["merged_saved"].items():
        torch.testing.assert_close(tensor, peft_merged[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("other", [("fsdp2", 2), ("torchtitan", 2)], ids=["fsdp2-x2", "torchtitan-x2"])
def test_two_ranks_and_torchtitan_train_the_adapter_one_fsdp2_rank_does(runs, other):
    """The same start on every rank and in both backends (whatever the seed), and the same adapter after two
    steps: torchtitan's modules take PEFT's layers under the HF projections' names."""
    one = runs[("fsdp2", 1)]
    assert set(one["adapter_before"]) == set(runs[other]["adapter_before"])
    for name, tensor in one["adapter_before"].items():
        assert torch.equal(tensor, runs[other]["adapter_before"][name]), name
    for name, tensor in one["adapter_saved"].items():
        torch.testing.assert_close(runs[other]["adapter_saved"][name], tensor, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("which", RUNS, ids=lambda w: f"{w[0]}-x{w[1]}")
def test_the_kl_reference_is_the_base_under_the_adapter_switched_off(runs, which):
    """No second copy of the model: after two steps the reference still computes the base model's logprobs
    (those of a fresh adapter, B = 0), while the policy's have moved, and the KL the loss reports is not zero."""
    run = runs[which]
    assert run["reference"] == "AdapterOff"
    torch.testing.assert_close(run["reference_logprobs"], run["base_logprobs"], rtol=0, atol=1e-5)
    assert (run["policy_logprobs"] - run["base_logprobs"]).abs().max() > 1e-3
    assert run["metrics"][1]["train/kl"] > 0


@pytest.mark.parametrize("which", RUNS, ids=lambda w: f"{w[0]}-x{w[1]}")
def test_a_checkpoint_resumes_to_the_same_next_step(runs, which):
    run = runs[which]
    assert run["step_loaded"] == 2
    for name, tensor in run["adapter_saved"].items():
        assert torch.equal(run["adapter_loaded"][name], tensor), name
    for name, tensor in run["adapter_third"].items():  # the optimizer state came back too
        torch.testing.assert_close(run["adapter_third_resumed"][name], tensor, rtol=0, atol=1e-7, msg=name)
    assert run["third_resumed"]["train/loss"] == pytest.approx(run["third"]["train/loss"], abs=1e-6)


def test_a_checkpoint_and_a_job_that_disagree_on_the_adapter_are_refused(runs, tiny_model_dir, tmp_path):
    """Resuming the LoRA checkpoint without train.lora (or with another rank), or a full checkpoint with it."""
    import shutil

    from miles_train import build_backend

    ckpt = runs[("fsdp2", 1)]["ckpt"]
    plain = build_backend(TrainConfig(), tiny_model_dir, 0, 1, f"tcp://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(ValueError, match=r"train.lora: checkpoint .* holds a LoRA adapter"):
            plain.load(ckpt)
        full = tmp_path / "full"
        plain.save(full)
    finally:
        plain.shutdown()
    other = TrainConfig.model_validate({"lora": {"rank": 2, "target_modules": list(TARGETS)}})
    adapter = build_backend(other, tiny_model_dir, 0, 1, f"tcp://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(ValueError, match=r"train.lora: checkpoint .* holds no adapter"):
            adapter.load(full)
        with pytest.raises(ValueError, match=r"trained with rank 4 \(this job: 2\); alpha 8.0 \(this job: 16.0\)"):
            adapter.load(ckpt)
        broken = shutil.copytree(ckpt, tmp_path / "broken")
        (broken / "adapter" / "adapter_model.safetensors").unlink()
        with pytest.raises(FileNotFoundError, match="adapter_model.safetensors is missing"):
            adapter.load(broken)
    finally:
        adapter.shutdown()


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"backend": "megatron", "lora": {}}, r"train.lora: backend megatron cannot train an adapter \(megatron-core"),
        (
            {"backend": {"type": "torchtitan", "world_size": 2, "tensor_parallel_size": 2}, "lora": {}},
            r"train.lora with train.backend.tensor_parallel_size 2: torchtitan",
        ),
        ({"lora": {}, "quantization": "int4"}, r"train.lora with train.quantization: int4"),
        ({"lora": {"rank": 0}}, r"rank"),
        ({"lora": {"target_modules": []}}, r"target_modules"),
    ],
)
def test_a_lora_spec_a_backend_cannot_run_is_refused_naming_why(train, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.model_validate(train)


def test_target_modules_the_model_lacks_are_refused_naming_the_field(tiny_model_dir):
    from miles_train import build_backend

    config = TrainConfig.model_validate({"lora": {"target_modules": ["query_key_value"]}})
    with pytest.raises(
        ValueError, match=r"train.lora.target_modules \['query_key_value'\]: .*linear modules: .*q_proj"
    ):
        build_backend(config, tiny_model_dir, 0, 1, f"tcp://127.0.0.1:{free_port()}")


def test_torchtitan_refuses_a_projection_its_model_lacks_naming_the_field():
    from miles_train.backends.torchtitan.convert import lora_hf_module, lora_peft_kwargs

    config = TrainConfig.model_validate({"lora": {"target_modules": ["q_proj", "query_key_value"]}})
    with pytest.raises(ValueError, match=r"target_modules \['query_key_value'\]: torchtitan's model has no such"):
        lora_peft_kwargs(config.lora.peft_kwargs())
    assert lora_peft_kwargs({"target_modules": ["up_proj", "down_proj"]})["target_modules"] == [
        "feed_forward.w3",
        "feed_forward.w2",
    ]
    assert lora_hf_module("layers.3.attention.qkv_linear.wk") == "model.layers.3.self_attn.k_proj"
