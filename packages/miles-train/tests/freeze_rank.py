"""One fsdp2 trainer rank of the train.freeze test, run as its own process (torch.distributed needs one).

usage: python freeze_rank.py MODEL_DIR RANK WORLD_SIZE PORT OUT_FILE PATTERNS_JSON CKPT_DIR PORT2

Two steps with the patterns frozen, a save, then a fresh trainer loads it and takes a third step; rank 0 records the
export before, after two steps and after the resumed third, the names the backend froze, the parameters the
optimizer holds (and holds state for) before and after the resume, and the metrics.
"""

import json
import sys

import torch

from miles_train import TrainConfig, build_backend

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from backend_rank import contract_batch  # noqa: E402


def main() -> None:
    model_dir, rank, world_size, port, out, patterns, ckpt, port2 = sys.argv[1:9]
    rank, world_size = int(rank), int(world_size)
    torch.set_num_threads(1)
    config = TrainConfig.model_validate(
        {"backend": {"type": "fsdp2", "world_size": world_size}, "freeze": json.loads(patterns),
         "optimizer": {"lr": 1e-2, "max_grad_norm": 1.0}}
    )  # fmt: skip
    trainer = build_backend(config, model_dir, rank, world_size, f"tcp://127.0.0.1:{port}")
    before = {name: t.clone() for name, t in trainer.export_weights()}
    metrics = [trainer.train_step(contract_batch()) for _ in range(2)]
    after = {name: t.clone() for name, t in trainer.export_weights()}
    optimizer = trainer.backend.optimizer
    with_state = sum(1 for group in optimizer.param_groups for p in group["params"] if p in optimizer.state)
    record = {"before": before, "after": after, "frozen": trainer.backend.frozen, "metrics": metrics,
              "optimizer_params": sum(len(g["params"]) for g in optimizer.param_groups), "with_state": with_state,
              "trainable": sum(1 for p in trainer.backend.model.parameters() if p.requires_grad)}  # fmt: skip
    trainer.save(ckpt)
    trainer.shutdown()
    resumed = build_backend(config, model_dir, rank, world_size, f"tcp://127.0.0.1:{port2}")
    resumed.load(ckpt)
    record["loaded"] = {name: t.clone() for name, t in resumed.export_weights()}
    record["resumed_metrics"] = resumed.train_step(contract_batch())
    record["third"] = {name: t.clone() for name, t in resumed.export_weights()}
    optimizer = resumed.backend.optimizer
    record["resumed_with_state"] = sum(1 for g in optimizer.param_groups for p in g["params"] if p in optimizer.state)
    resumed.shutdown()
    if rank == 0:
        torch.save(record, out)


if __name__ == "__main__":
    main()
