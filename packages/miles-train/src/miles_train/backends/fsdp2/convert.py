"""HF ⇄ FSDP2: the FSDP2 backend trains the transformers model itself, so names and layouts are the HF
checkpoint's; what remains is the model family check and the tied-head rule (miles_sync.naming)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from miles_sync import without_tied_head
from miles_train.backends.hf_io import with_tied_head


def load_hf_model(model_path: str | Path, device: torch.device) -> torch.nn.Module:
    """The transformers causal LM of an HF folder, fp32 master weights on `device`."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).to(device)


def to_hf(hf_config: Any, state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors from the model's full state dict: a tied head is the embedding, sent once."""
    yield from without_tied_head(state.items(), bool(getattr(hf_config, "tie_word_embeddings", False)))


def from_hf(hf_config: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's state dict from a checkpoint's tensors (a tied head named again)."""
    return with_tied_head(hf_config, tensors)
