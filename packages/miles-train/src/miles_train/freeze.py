"""`train.freeze`: parameters a job does not train, named by patterns over the checkpoint's parameter names
(shell-style, `fnmatch`: `model.embed_tokens.*`, `model.layers.0.*`, `visual.*` for a vision tower).

A frozen parameter takes no gradient and no optimizer state, and never changes, so the engines already hold it
(they loaded the same checkpoint): with `sync.delta` a push sends only the tensors that changed, and a frozen one is
never among them after the first push. The patterns are checked against the checkpoint's tensor names before
anything starts (`check_patterns`), and against the trainer's own parameters when it loads the model (`freeze`).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch


def matches(names: Iterable[str], patterns: Sequence[str]) -> list[list[str]]:
    """For each pattern, the names it matches (in the order given)."""
    names = list(names)
    return [[n for n in names if fnmatch.fnmatchcase(n, pattern)] for pattern in patterns]


def check_patterns(names: Sequence[str], patterns: Sequence[str], where: str = "the model") -> set[str]:
    """The names the patterns freeze; ValueError naming `train.freeze[i]` for a pattern that matches none of
    `names`, or when every name would be frozen."""
    found = matches(names, patterns)
    for index, (pattern, hits) in enumerate(zip(patterns, found, strict=True)):
        if not hits:
            examples = ", ".join(list(names)[:3])
            raise ValueError(
                f"train.freeze[{index}]: {pattern!r} matches no parameter of {where} (its names look like {examples}, "
                "…; patterns are shell-style over the checkpoint's names)"
            )
    frozen = {n for hits in found for n in hits}
    if names and frozen >= set(names):
        raise ValueError(f"train.freeze: the patterns freeze every parameter of {where}; nothing would train")
    return frozen


def checkpoint_names(model_path: str | Path) -> list[str]:
    """The tensor names of an HF checkpoint folder, read from its safetensors headers (no tensor is loaded)."""
    from safetensors import safe_open

    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return sorted(json.loads(index.read_text())["weight_map"])
    names: list[str] = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            names.extend(handle.keys())
    return sorted(names)


def freeze(model: torch.nn.Module, patterns: Sequence[str]) -> list[str]:
    """Turn off `requires_grad` of the parameters the patterns match (names as `model.named_parameters()` gives
    them: the checkpoint's, a tied head once, as the embedding); the names frozen. ValueError as `check_patterns`."""
    params = dict(model.named_parameters())
    frozen = check_patterns(list(params), patterns, "the trainer's model")
    for name in frozen:
        params[name].requires_grad_(False)
    return sorted(frozen)
