"""miles-train alone, from your own script (no Ray, no miles-rollout, no miles-control): GRPO steps on
token ids and rewards you bring, with the fsdp2 backend on one rank, then the weights under HF names for
any inference engine.

    pip install packages/miles-sync packages/miles-train
    python train_alone.py MODEL_DIR

Several ranks: start one process per rank (torchrun, or your own launcher) with the same `init_method`;
`train.backend: megatron` or `torchtitan` (pip install 'miles-train[megatron]' / '[torchtitan]') swap in.
"""

from __future__ import annotations

import socket
import sys

from miles_train import TrainConfig, build_backend
from miles_train.types import TrainBatch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(model_dir: str) -> None:
    config = TrainConfig.model_validate({"backend": "fsdp2", "optimizer": {"lr": 1e-3}})
    trainer = build_backend(config, model_dir, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        # Two prompts, two responses each (a GRPO group per prompt), from whatever generated them.
        prompts, responses = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14], [10], [11, 12]]
        rows = [prompts[i // 2] + r for i, r in enumerate(responses)]
        batch = TrainBatch(
            input_ids=rows,
            response_start=[len(prompts[i // 2]) for i in range(len(responses))],
            rollout_logprobs=[[-2.0] * len(r) for r in responses],  # what the generator reported
            loss_mask=[[1] * len(r) for r in responses],
            rewards=[1.0, 0.0, 0.0, 1.0],
            group_index=[0, 0, 1, 1],
            temperature=1.0,
        )
        for step in (1, 2):
            metrics = trainer.train_step(batch)
            print(f"step {step}: loss {metrics['train/loss']:.4f}, tokens {metrics['train/num_tokens']:.0f}")
        weights = dict(trainer.export_weights())  # full tensors under HF names (a tied head once)
    finally:
        trainer.shutdown()
    print(f"exported {len(weights)} tensors, e.g. {sorted(weights)[0]}")


if __name__ == "__main__":
    main(sys.argv[1])
