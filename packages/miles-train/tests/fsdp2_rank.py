"""One trainer rank for the backend contract tests, run as its own process (torch.distributed needs one).

usage: python fsdp2_rank.py MODEL_DIR RANK WORLD_SIZE PORT OUT_FILE CKPT_DIR [MIXED_PRECISION]
"""

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


def snapshot(backend) -> dict[str, torch.Tensor]:
    # Exported tensors may alias live parameters (on CPU), so copy them before training on.
    return {name: tensor.clone() for name, tensor in backend.export_weights()}


def main() -> None:
    model_dir, rank, world_size, port, out, ckpt = sys.argv[1:7]
    mixed = sys.argv[7] if len(sys.argv) > 7 else "none"
    rank, world_size = int(rank), int(world_size)
    torch.set_num_threads(1)
    config = TrainConfig.model_validate(
        {
            "backend": {"world_size": world_size, "mixed_precision": mixed},
            "optimizer": {"lr": 1e-3, "max_grad_norm": 1.0},
            "grpo": {"old_logprobs": "recompute", "kl_coef": 0.1},
        }
    )
    backend = build_backend(config, model_dir, rank, world_size, f"tcp://127.0.0.1:{port}")
    batch = contract_batch()
    result = {"initial": snapshot(backend)}
    result["logprobs"] = backend.compute_logprobs(batch)
    result["metrics"] = backend.train_step(batch)
    result["after"] = snapshot(backend)
    result["logprobs_after"] = backend.compute_logprobs(batch)
    backend.save(ckpt)
    result["metrics2"] = backend.train_step(batch)
    result["after2_fp"] = weight_fingerprint(backend.export_weights())
    backend.load(ckpt)
    result["reloaded"] = snapshot(backend)
    result["metrics_after_reload"] = backend.train_step(batch)
    result["after_reload_step_fp"] = weight_fingerprint(backend.export_weights())
    backend.shutdown()
    if rank == 0:
        torch.save(result, out)


if __name__ == "__main__":
    main()
