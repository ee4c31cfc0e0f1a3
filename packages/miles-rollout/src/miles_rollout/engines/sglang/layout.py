"""SGLang's internal weight layout for Llama/Qwen2/Qwen3-style models, and its per-tensor checksums.

SGLang fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (concatenated along dim 0), and
pads the vocabulary rows of the embedding and LM head with zeros; its `/weights_checker`
`checksum` action reports, per internal tensor, the first 8 bytes of the
SHA-256 of the tensor's bytes (on CPU). Computing the same from the HF tensors a trainer published
gives a bit-exact equality check without reading the weights back.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

import torch

# config.json model_type values whose layout this module computes: Mistral's is Llama's; Phi-3's checkpoint holds
# qkv_proj and gate_up_proj already fused, as SGLang does; OLMo-2 adds its q/k and post-layer norms under their names
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "olmo2")

_FUSED = [
    (re.compile(r"^(.*\.self_attn)\.(q|k|v)_proj\.(weight|bias)$"), "qkv_proj", ("q", "k", "v")),
    (re.compile(r"^(.*\.mlp)\.(gate|up)_proj\.(weight)$"), "gate_up_proj", ("gate", "up")),
]


# SGLang pads the vocabulary dimension of these to a multiple of 64 rows, filled with zeros.
_VOCAB_PADDED = ("model.embed_tokens.weight", "lm_head.weight")
VOCAB_PADDING = 64


def _pad_vocab(tensor: torch.Tensor) -> torch.Tensor:
    rows = -(-tensor.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
    if rows == tensor.shape[0]:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))])


def sglang_checksum(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).digest()[:8].hex()


def expected_checksums(
    named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> dict[str, str]:
    """Checksums SGLang will report for these HF-named tensors once loaded into `dtype` parameters."""
    plain: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    order: dict[str, tuple[str, ...]] = {}
    for name, tensor in named_tensors:
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        for pattern, fused, members in _FUSED:
            match = pattern.match(name)
            if match:
                key = f"{match.group(1)}.{fused}.{match.group(3)}"
                parts.setdefault(key, {})[match.group(2)] = tensor
                order[key] = members
                break
        else:
            plain[name] = tensor
    out = {name: sglang_checksum(_pad_vocab(t) if name in _VOCAB_PADDED else t) for name, t in plain.items()}
    for key, members in parts.items():
        missing = [m for m in order[key] if m not in members]
        if missing:
            raise ValueError(f"{key}: missing {missing} projections among the published weights")
        out[key] = sglang_checksum(torch.cat([members[m] for m in order[key]], dim=0))
    return out
