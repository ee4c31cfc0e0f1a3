"""`train.freeze`: parameters a job does not train, named by shell-style patterns (`fnmatch`: `model.embed_tokens.*`,
`model.layers.0.*`) over the parameter names of the model the trainer builds (transformers' `named_parameters()`).

For dense text models these are the checkpoint's tensor names. They differ where transformers holds a tensor in
another layout than the checkpoint (a mixture of experts' fused `mlp.experts.gate_up_proj` for the checkpoint's
per-expert tensors) and a tied head is the embedding: `model.embed_tokens.*` freezes both.

A frozen parameter takes no gradient and no optimizer state, and never changes, so the engines already hold it
(they loaded the same checkpoint): with `sync.delta` a push sends only the tensors that changed, and a frozen one is
never among them after the first push. The patterns are checked before anything starts against the model built on
the meta device (`parameter_names`: no weight is read) and again when the trainer loads it (`freeze`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

TIED_HEAD = "lm_head.weight"


def matches(names: Iterable[str], patterns: Sequence[str]) -> list[list[str]]:
    """For each pattern, the names it matches (in the order given)."""
    names = list(names)
    return [[n for n in names if fnmatch.fnmatchcase(n, pattern)] for pattern in patterns]


def check_patterns(names: Sequence[str], patterns: Sequence[str], where: str = "the model") -> set[str]:
    """The names the patterns freeze; ValueError naming `train.freeze[i]` for a pattern that matches none of
    `names`, or when every name would be frozen."""
    found = matches(names, patterns)
    for index, (pattern, hits) in enumerate(zip(patterns, found, strict=True)):
        if hits:
            continue
        if fnmatch.fnmatchcase(TIED_HEAD, pattern) and "model.embed_tokens.weight" in names:
            hint = "this model ties its head to the embedding: model.embed_tokens.* freezes both"
        elif names:
            hint = f"its names look like {', '.join(list(names)[:3])}, …"
        else:
            hint = "it has no parameters"
        raise ValueError(f"train.freeze[{index}]: {pattern!r} matches no parameter of {where} ({hint})")
    frozen = {n for hits in found for n in hits}
    if names and frozen >= set(names):
        raise ValueError(f"train.freeze: the patterns freeze every parameter of {where}; nothing would train")
    return frozen


def parameter_names(model_path: str | Path) -> list[str]:
    """The parameter names of the model transformers builds from an HF folder (a causal LM, or a vision-language
    model with its tower), built on the meta device (its config alone: no weight is read, no memory taken): what
    `freeze` will see in the trainer."""
    import transformers

    from miles_sync.vision import model_class_name

    config = transformers.AutoConfig.from_pretrained(str(model_path))
    with torch.device("meta"):
        model = getattr(transformers, model_class_name(config)).from_config(config)
    return [name for name, _ in model.named_parameters()]


def freeze(model: torch.nn.Module, patterns: Sequence[str]) -> list[str]:
    """Turn off `requires_grad` of the parameters the patterns match (names as `model.named_parameters()` gives
    them: a tied head once, as the embedding); the names frozen. ValueError as `check_patterns`."""
    params = dict(model.named_parameters())
    frozen = check_patterns(list(params), patterns, "the trainer's model")
    for name in frozen:
        params[name].requires_grad_(False)
    return sorted(frozen)
