"""One trainer rank of the LoRA tests, run as its own process (torch.distributed needs one).

usage: python lora_rank.py MODEL_DIR RANK WORLD_SIZE PORT OUT_FILE CKPT_DIR PORT2 BACKEND

A trainer of BACKEND (fsdp2 or torchtitan) with `train.lora` (rank 4 on q_proj and v_proj, KL to the base): two steps, a save, a third step,
then a fresh trainer loads the checkpoint and takes the third step again. Rank 0 records the merged export before
and after, the adapter after each step, the optimizer's state and both third steps; and the KL reference's and the
policy's logprobs after two steps, and the fresh trainer's before it loads (its adapter's B is zero: the base model's).
"""

import sys

import torch

from miles_train import TrainConfig, build_backend

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from backend_rank import contract_batch  # noqa: E402

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}


def exported(backend, mode: str) -> dict[str, torch.Tensor]:
    backend.set_lora_push(mode)
    return {name: t.clone() for name, t in backend.export_weights()}


def main() -> None:
    model_dir, rank, world_size, port, out, ckpt, port2, backend_type = sys.argv[1:9]
    rank, world_size = int(rank), int(world_size)
    torch.set_num_threads(1)
    torch.manual_seed(rank)  # ranks seeded apart, as jobs do: the adapter's start must not depend on it
    config = TrainConfig.model_validate(
        {
            "backend": {"type": backend_type, "world_size": world_size},
            "lora": LORA,
            "optimizer": {"lr": 1e-2, "max_grad_norm": 1.0},
            "algorithm": {"kl_coef": 0.1, "old_logprobs": "recompute"},
        }
    )
    backend = build_backend(config, model_dir, rank, world_size, f"tcp://127.0.0.1:{port}")
    record: dict = {"merged_before": exported(backend, "merge"), "adapter_before": exported(backend, "adapter")}
    record["metrics"] = [backend.train_step(contract_batch()) for _ in range(2)]
    record["reference"] = type(backend.reference).__name__
    record["reference_logprobs"] = backend._padded_logprobs(contract_batch(), model=backend.reference)
    record["policy_logprobs"] = backend._padded_logprobs(contract_batch())
    record["adapter_saved"] = exported(backend, "adapter")
    record["merged_saved"] = exported(backend, "merge")
    backend.save(ckpt)
    record["optimizer_params"] = len(backend.backend.optimizer.state)
    record["third"] = backend.train_step(contract_batch())
    record["adapter_third"] = exported(backend, "adapter")
    backend.shutdown()

    resumed = build_backend(config, model_dir, rank, world_size, f"tcp://127.0.0.1:{port2}")
    record["base_logprobs"] = resumed._padded_logprobs(contract_batch())
    resumed.load(ckpt)
    record["adapter_loaded"] = exported(resumed, "adapter")
    record["step_loaded"] = resumed.step
    record["third_resumed"] = resumed.train_step(contract_batch())
    record["adapter_third_resumed"] = exported(resumed, "adapter")
    resumed.shutdown()
    if rank == 0:
        torch.save(record, out)


if __name__ == "__main__":
    main()
