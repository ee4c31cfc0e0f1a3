"""HF ⇄ FSDP2: the FSDP2 backend trains the transformers model itself, so names and layouts are the HF
checkpoint's, but for the tied-head rule and the tensors transformers holds in another layout than it saves (a
mixture of experts' fused expert weights): both through miles_sync.naming, the layout from transformers' own
conversion (`revert_weight_conversion`, what `save_pretrained` applies)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from miles_sync import without_tied_head
from miles_sync.naming import checkpoint_views, unconverted
from miles_sync.vision import model_class_name, suppress_placeholders
from miles_train.backends.hf_io import with_tied_head


def load_hf_model(model_path: str | Path, device: torch.device) -> torch.nn.Module:
    """The transformers model of an HF folder (a causal LM, or a vision-language model with its vision tower), fp32
    master weights on `device`; a vision-language model's image placeholders are never predicted
    (`miles_sync.vision.suppress_placeholders`, as in the engines)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(model_path))
    model = getattr(transformers, model_class_name(config)).from_pretrained(str(model_path), dtype=torch.float32)
    suppress_placeholders(model)
    return model.to(device)


def checkpoint_layout(model: torch.nn.Module) -> Callable[[dict], dict]:
    """Model-named tensors → checkpoint-named ones, as `save_pretrained` writes them (transformers' own conversion:
    e.g. a mixture of experts' fused 3-D expert weights split per expert); the identity for most families."""
    from transformers.core_model_loading import revert_weight_conversion

    return lambda tensors: revert_weight_conversion(model, tensors)


def to_hf(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors from the model's full state dict (views, under the checkpoint's names and shapes):
    a tied head is the embedding, sent once."""
    views = checkpoint_views(state, checkpoint_layout(model), _kept(model, state))
    yield from without_tied_head(views.items(), bool(getattr(model.config, "tie_word_embeddings", False)))


def converted(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """The model tensors whose checkpoint layout differs (split or renamed on export)."""
    kept = _kept(model, state)
    return [name for name in state if name not in kept]


def _kept(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> set[str]:
    """The state's names that the checkpoint holds as they are, worked out once per model and set of names (every
    push asks again)."""
    key = tuple(state)
    cached = getattr(model, "_miles_unconverted", None)
    if cached is None or cached[0] != key:
        cached = (key, unconverted(state, checkpoint_layout(model)))
        model._miles_unconverted = cached  # type: ignore[assignment]  # a plain attribute: not a parameter or buffer
    return cached[1]


def from_hf(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's full state dict from a checkpoint's tensors (a tied head named again; converted tensors
    assembled in the model's layout)."""
    tensors = with_tied_head(model.config, tensors)
    shapes = {name: t.shape for name, t in get_model_state_dict(model).items()}
    if set(shapes) == set(tensors):
        return tensors
    state = {name: torch.empty(shape) for name, shape in shapes.items()}
    views = checkpoint_views(state, checkpoint_layout(model))
    missing = sorted(set(views) - set(tensors))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}")
    for name, view in views.items():
        view.copy_(tensors[name])
    return state
