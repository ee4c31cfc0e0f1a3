"""One trainer rank for the backend contract tests, run as its own process (torch.distributed needs one).

usage: python backend_rank.py MODEL_DIR RANK WORLD_SIZE PORT OUT_FILE CKPT_DIR [VARIANT] [offpolicy]

VARIANT names the backend, its layout and its precision: `fsdp2`, `megatron`, `megatron-tp2`, `megatron-ep2` (a
mixture of experts' experts over two ranks), `torchtitan`, `torchtitan-tp2` (without `-tp2` every rank is data
parallel), each optionally ending in `-bf16` or `-fp16`
(train.precision).

`offpolicy` turns on truncated importance sampling (cap 1.5) and staleness decay (0.5 per version),
with staleness 0, 1, 2 within each group (`offpolicy-partial`: each token its own age, `partial_ages`). `pushed` tells the backend that the engines hold bf16 weights
(`set_push_dtype`): it forwards with the weights as pushed and recomputes old logprobs under them.
`offpolicy-int4push` is `offpolicy` with pushes quantized to INT4 (sync.quantization) and an unquantized trainer.
`qat-FORMAT` sets train.quantization (int4 groups of 32); `mis` masks tokens whose ratio leaves [0.4, 3] on the
off-policy batch.
`json:{...}` takes one step with train.algorithm, its shared loss settings and the learning rate from the JSON
(`{"algorithm": {...}, "settings": {...}, "lr": 1e-12, "max_grad_norm": null, "teacher": DIR, "critic": {...}, "batch": "offpolicy",
"expect_error": true, "resume": true, "routed": FILE, "replay": true}`; `routed`: the engine's routing of each row,
recorded with the logprobs before the step); an expected error is recorded with the weights after it instead of failing
the rank; `resume` runs the whole sequence below (step, save, step, load, step) instead of one step.
"""

import json
import os
import sys

import torch

from miles_sync import weight_fingerprint
from miles_train import TrainConfig, build_backend
from miles_train.types import TrainBatch


def contract_batch() -> TrainBatch:
    """Two groups of three samples with varied lengths and rewards (fixed, so every rank agrees)."""
    prompts = [[5, 6, 7], [8, 9]]
    responses = [[[10, 11, 1], [12, 1], [13, 14, 15]], [[4, 1], [4, 5, 1], [6]]]
    rewards = [[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]]
    rows = dict(input_ids=[], response_start=[], rollout_logprobs=[], loss_mask=[], rewards=[], group_index=[])
    for g, prompt in enumerate(prompts):
        for resp, reward in zip(responses[g], rewards[g], strict=True):
            rows["input_ids"].append(prompt + resp)
            rows["response_start"].append(len(prompt))
            rows["rollout_logprobs"].append([-2.0] * len(resp))
            rows["loss_mask"].append([1] * len(resp))
            rows["rewards"].append(reward)
            rows["group_index"].append(g)
    return TrainBatch(**rows)


def offpolicy_batch() -> TrainBatch:
    """The contract batch as stale data: ages 0, 1, 2 per group, and rollout logprobs that make the
    importance ratio fall on both sides of the cap (−2 and −4 alternate; the model's are near −2.8)."""
    batch = contract_batch()
    batch.staleness = [0, 1, 2, 0, 1, 2]
    batch.rollout_logprobs = [[-2.0 if j % 2 == 0 else -4.0 for j in range(len(r))] for r in batch.rollout_logprobs]
    return batch


def partial_ages(batch: TrainBatch) -> list[list[int]]:
    """Partial rollouts: each sample's first response token as old as the sample, the rest (continued after a
    weight push) one version younger."""
    assert batch.staleness is not None
    return [
        [age if j == 0 else max(age - 1, 0) for j in range(len(mask))]
        for age, mask in zip(batch.staleness, batch.loss_mask, strict=True)
    ]


def snapshot(backend) -> dict[str, torch.Tensor]:
    # Exported tensors may alias live parameters (on CPU), so copy them before training on.
    return {name: tensor.clone() for name, tensor in backend.export_weights()}


PRECISIONS = ("bf16", "fp16")


def backend_config(variant: str, world_size: int) -> tuple[dict, str]:
    """The backend mapping and train.precision of a variant: `kind[-tp2][-bf16|-fp16]`."""
    kind, *options = variant.split("-")
    precision = next((o for o in options if o in PRECISIONS), "fp32")
    if kind == "fsdp2":
        return {"type": "fsdp2", "world_size": world_size}, precision
    config = {"type": kind, "world_size": world_size, "tensor_parallel_size": 2 if "tp2" in options else 1}
    if "ep2" in options:  # megatron: a mixture of experts' experts over two ranks
        config["expert_parallel_size"] = 2
    return config, precision


def main() -> None:
    model_dir, rank, world_size, port, out, ckpt = sys.argv[1:7]
    variant = sys.argv[7] if len(sys.argv) > 7 else "fsdp2"
    mode = sys.argv[8] if len(sys.argv) > 8 else ""
    offpolicy = mode.startswith("offpolicy")
    rank, world_size = int(rank), int(world_size)
    torch.set_num_threads(1)
    settings = {"old_logprobs": "recompute", "kl_coef": 0.1}  # train.algorithm's shared loss settings
    if offpolicy:
        settings |= {"tis_cap": 1.5, "staleness": "decay", "staleness_decay": 0.5}
    if mode == "mis":
        settings |= {"mis_band": (0.4, 3.0)}
    custom = json.loads(mode.removeprefix("json:")) if mode.startswith("json:") else {}
    settings |= custom.get("settings", {})
    if custom.get("teacher"):
        settings["kl_coef"] = 0.0  # distill's frozen model is the teacher
    algorithm = custom.get("algorithm", "grpo")
    algorithm = ({"name": algorithm} if isinstance(algorithm, str) else algorithm) | settings
    backend_cfg, precision = backend_config(variant, world_size)
    quantization = mode.removeprefix("qat-") if mode.startswith("qat-") else "none"
    config = TrainConfig.model_validate(
        {
            "backend": backend_cfg,
            "precision": precision,
            "quantization": quantization,
            "quant_group_size": 32,
            "optimizer": {"lr": custom.get("lr", 1e-3), "max_grad_norm": custom.get("max_grad_norm", 1.0)},
            "algorithm": algorithm,
            "teacher": custom.get("teacher"),
            "critic": custom.get("critic"),
            "routing_replay": custom.get("replay", False),
        }
    )
    backend = build_backend(config, model_dir, rank, world_size, f"tcp://127.0.0.1:{port}")
    if custom and not custom.get("resume"):
        batch = offpolicy_batch() if custom.get("batch") == "offpolicy" else contract_batch()
        if custom.get("routed"):  # a mixture of experts: the engine's routing of every row (a torch.save'd list)
            batch.routed_experts = torch.load(custom["routed"])
        one_step(backend, rank, out, custom.get("expect_error", False), batch)
        return
    if mode == "pushed":
        backend.set_push_dtype("bfloat16")
    if mode == "offpolicy-int4push":  # the engines run INT4 weights; the trainer does not quantize
        backend.set_push_dtype(None, "int4", 32)
    batch = offpolicy_batch() if offpolicy or mode == "mis" or custom.get("batch") == "offpolicy" else contract_batch()
    if mode == "offpolicy-partial":
        batch.token_staleness = partial_ages(batch)
    result = {"initial": snapshot(backend)}
    result["logprobs"] = backend.compute_logprobs(batch)
    result["metrics"] = backend.train_step(batch)
    result["after"] = snapshot(backend)
    result["logprobs_after"] = backend.compute_logprobs(batch)
    backend.save(ckpt)
    result["metrics2"] = backend.train_step(batch)
    result["after2_fp"] = weight_fingerprint(backend.export_weights())
    result["critic_after2_fp"] = critic_fingerprint(backend)
    backend.load(ckpt)
    result["reloaded"] = snapshot(backend)
    result["metrics_after_reload"] = backend.train_step(batch)
    result["after_reload_step_fp"] = weight_fingerprint(backend.export_weights())
    result["critic_after_reload_step_fp"] = critic_fingerprint(backend)
    backend.shutdown()
    if rank == 0:
        torch.save(result, out)


def critic_fingerprint(backend) -> str | None:
    """PPO's value model after a step (its weights follow from the weights and the AdamW state before it)."""
    if backend.critic is None:
        return None
    return weight_fingerprint((n, p.detach().clone()) for n, p in backend.critic.model.named_parameters())


def one_step(backend, rank: int, out: str, expect_error: bool, batch: TrainBatch) -> None:
    """One step on `batch`: its metrics and the weights before and after (or the error it raised)."""
    result = {"initial": snapshot(backend)}
    if batch.routed_experts is not None:
        result["logprobs"] = backend.compute_logprobs(batch)
    try:
        result["metrics"] = backend.train_step(batch)
    except ValueError as exc:
        if not expect_error:
            raise
        result["error"] = str(exc)
    result["after"] = snapshot(backend)
    backend.shutdown()
    if rank == 0:
        torch.save(result, out)


if __name__ == "__main__":
    main()
    # The rank's work is done and its result written (rank 0 after the group's closing barrier). Leave without the
    # interpreter's teardown: under load, C++ destructors of gloo's threads have aborted at exit ("terminate called
    # without an active exception") in a rank whose work had finished, failing the test for nothing it checks.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
