"""Trainer checkpoints, one format for every backend.

A checkpoint folder holds the weights as an HF folder (`config.json` + `model.safetensors`, a tied head
once), the optimizer state (`optimizer.pt`, full; or `optimizer-rank{r}.pt`, one per rank, for a backend
whose optimizer state is sharded in its own layout) and `trainer_state.json`: the step and the layout that
wrote it. A backend loads a checkpoint only when the fields its optimizer state depends on match its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles_train.backends.hf_io import read_hf_state, save_hf_weights

STATE_FILE = "trainer_state.json"
TEACHER_FILE = "teacher.json"  # distill: which teacher the policy was trained against
SAMPLED = 1 << 20  # of each weights file, the first and last MiB enter its identity


@dataclass
class TrainerState:
    """What `trainer_state.json` holds."""

    backend: str
    step: int
    world_size: int = 1
    tensor_parallel_size: int = 1
    padded_vocab: int | None = None  # tensor-parallel layouts pad the vocabulary: the optimizer state's rows
    expert_parallel_size: int = 1  # megatron: which experts (and their optimizer state) each rank holds

    @classmethod
    def read(cls, directory: Path) -> TrainerState:
        path = directory / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{directory} is not a trainer checkpoint: no {STATE_FILE}")
        data = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def check_loadable_by(self, mine: TrainerState, must_match: tuple[str, ...], directory: Path) -> None:
        """Raise naming each field of `must_match` (and the backend) in which this checkpoint differs."""
        differ = [  # a field the checkpoint does not record (written before it existed) is not compared
            name
            for name in ("backend", *must_match)
            if getattr(self, name) is not None and getattr(self, name) != getattr(mine, name)
        ]
        if differ:
            written = ", ".join(f"{name} {getattr(self, name)}" for name in differ)
            here = ", ".join(f"{name} {getattr(mine, name)}" for name in differ)
            raise ValueError(
                f"{mine.backend}: checkpoint {directory} was written with {written}; this trainer has {here} "
                "(its optimizer state does not fit)"
            )


def save_checkpoint(
    directory: str | Path,
    rank: int,
    hf_config: Any,
    weights: dict[str, torch.Tensor],
    state: TrainerState,
    optimizer_state: dict,
    per_rank_optimizer: bool = False,
    optimizer_io: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> None:
    """Collective: every rank calls it. Rank 0 writes the weights, the state and a full optimizer state;
    with `per_rank_optimizer` every rank writes its own (inside `optimizer_io()`, e.g. a device context)."""
    directory = Path(directory)
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        save_hf_weights(directory, hf_config, weights)
        if not per_rank_optimizer:
            torch.save(optimizer_state, directory / "optimizer.pt")
        (directory / STATE_FILE).write_text(json.dumps(asdict(state)))
    dist.barrier()
    if per_rank_optimizer:
        with optimizer_io():
            torch.save(optimizer_state, directory / f"optimizer-rank{rank}.pt")
        dist.barrier()


def folder_identity(model_path: str | Path) -> dict[str, str]:
    """A frozen model's identity, cheap enough for a teacher of any size: the sha256 of its config.json (less
    `transformers_version`, which a re-save by a newer transformers changes) and, for each weights file
    (`*.safetensors`, `*.bin`), of its size, its first and last MiB (for safetensors, the header before them: every
    tensor's name, dtype, shape and offsets). Two folders with equal identities hold the same model unless weights
    were edited in place in the middle of a file without changing a shape."""
    folder = Path(model_path)
    config = json.loads((folder / "config.json").read_text())
    config.pop("transformers_version", None)
    out = {"config.json": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()}
    for file in sorted([*folder.glob("*.safetensors"), *folder.glob("*.bin")]):
        digest = hashlib.sha256()
        size = file.stat().st_size
        digest.update(str(size).encode())
        with file.open("rb") as f:
            if file.suffix == ".safetensors":
                header = int.from_bytes(f.read(8), "little")
                digest.update(f.read(min(header, size)))
            digest.update(f.read(SAMPLED))
            f.seek(max(f.tell(), size - SAMPLED))
            digest.update(f.read(SAMPLED))
        out[file.name] = digest.hexdigest()
    return out


def save_teacher(directory: str | Path, teacher: str, identity: dict[str, str]) -> None:
    """Record the teacher a checkpoint's policy was distilled from (rank 0 calls it)."""
    (Path(directory) / TEACHER_FILE).write_text(json.dumps({"path": teacher, "identity": identity}, indent=1))


def check_teacher(directory: str | Path, teacher: str, identity: dict[str, str]) -> bool:
    """Raise (naming train.teacher and what differs) when the checkpoint was distilled from another teacher; False
    when it records none (written by another algorithm, or before the record existed)."""
    path = Path(directory) / TEACHER_FILE
    if not path.is_file():
        return False
    saved = json.loads(path.read_text())
    differ = sorted(k for k in set(saved["identity"]) | set(identity) if saved["identity"].get(k) != identity.get(k))
    if differ:
        raise ValueError(
            f"train.teacher: {teacher} is not the teacher checkpoint {directory} was distilled from ({saved['path']}): "
            f"{', '.join(differ)} differ. Resume with that teacher, or start a new job from this checkpoint"
        )
    return True


@dataclass
class Checkpoint:
    state: TrainerState
    hf_state: dict[str, torch.Tensor]  # fp32, as the folder holds them (a tied head once)
    optimizer_state: dict


def load_checkpoint(
    directory: str | Path,
    mine: TrainerState,
    must_match: tuple[str, ...] = (),
    rank: int = 0,
    per_rank_optimizer: bool = False,
    optimizer_io: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Checkpoint:
    """Read a checkpoint this trainer (`mine`: its backend and layout) can resume from."""
    directory = Path(directory)
    state = TrainerState.read(directory)
    state.check_loadable_by(mine, must_match, directory)
    name = f"optimizer-rank{rank}.pt" if per_rank_optimizer else "optimizer.pt"
    with optimizer_io():
        optimizer_state = torch.load(directory / name, weights_only=False)
    return Checkpoint(state, read_hf_state(directory), optimizer_state)
