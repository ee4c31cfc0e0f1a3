"""HF checkpoint folders as the trainers read and write them: every tensor in fp32, `config.json` +
`model.safetensors` as `save_pretrained` writes them, and the tied-head rule (miles_sync.naming)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def read_hf_state(model_path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint folder (`*.safetensors`), in fp32."""
    from safetensors.torch import load_file

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_path}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update({k: v.float() for k, v in load_file(str(file)).items()})
    return state


def save_hf_weights(directory: Path, hf_config: Any, tensors: dict[str, torch.Tensor]) -> None:
    """`config.json` + `model.safetensors` as `save_pretrained` writes them: a tied head is left out
    (it is the embedding; safetensors refuses tensors that share memory)."""
    from safetensors.torch import save_file

    from miles_sync import without_tied_head

    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    hf_config.save_pretrained(directory)
    weights = {k: v.contiguous() for k, v in without_tied_head(tensors.items(), tied)}
    save_file(weights, str(directory / "model.safetensors"))


def with_tied_head(hf_config: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF state dict of a checkpoint folder: a tied model's head named again (as `state_dict()` has it)."""
    if getattr(hf_config, "tie_word_embeddings", False) and "lm_head.weight" not in tensors:
        return {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}
    return tensors
