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
# qkv_proj and gate_up_proj already fused, as SGLang does; OLMo-2 adds its q/k and post-layer norms under their names;
# Qwen3-MoE's and Mixtral's experts are stacked (below)
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "olmo2", "qwen3_moe", "mixtral")

_FUSED = [
    (re.compile(r"^(.*\.self_attn)\.(q|k|v)_proj\.(weight|bias)$"), "qkv_proj", ("q", "k", "v")),
    (re.compile(r"^(.*\.mlp)\.(gate|up)_proj\.(weight)$"), "gate_up_proj", ("gate", "up")),
]


# A mixture of experts: SGLang's FusedMoE holds every expert of a layer in two stacked tensors, `w13_weight`
# [experts, 2 × moe_intermediate, hidden] (each expert's gate then up projection) and `w2_weight` [experts, hidden,
# moe_intermediate] (its down projection); the router stays `mlp.gate.weight`. Mixtral's checkpoint names the
# projections w1 (gate), w3 (up) and w2 (down), under `block_sparse_moe`.
_EXPERT = re.compile(
    r"^(.*\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_PROJECTION = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def _stack_experts(experts: dict[str, dict[int, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """SGLang's stacked expert tensors from the checkpoint's per-expert projections (prefix → expert → projection)."""
    out = {}
    for prefix, by_expert in experts.items():
        order = sorted(by_expert)
        if order != list(range(len(order))) or any(set(by_expert[e]) != {"gate", "up", "down"} for e in order):
            raise ValueError(f"{prefix}: the published weights miss experts or projections (experts {order})")
        out[f"{prefix}.w13_weight"] = torch.stack(
            [torch.cat([by_expert[e]["gate"], by_expert[e]["up"]]) for e in order]
        )
        out[f"{prefix}.w2_weight"] = torch.stack([by_expert[e]["down"] for e in order])
    return out


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
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in named_tensors:
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        expert = _EXPERT.match(name)
        if expert:
            projection = _PROJECTION[expert.group(3)]
            experts.setdefault(expert.group(1), {}).setdefault(int(expert.group(2)), {})[projection] = tensor
            continue
        for pattern, fused, members in _FUSED:
            match = pattern.match(name)
            if match:
                key = f"{match.group(1)}.{fused}.{match.group(3)}"
                parts.setdefault(key, {})[match.group(2)] = tensor
                order[key] = members
                break
        else:
            plain[name] = tensor
    plain |= _stack_experts(experts)
    out = {name: sglang_checksum(_pad_vocab(t) if name in _VOCAB_PADDED else t) for name, t in plain.items()}
    for key, members in parts.items():
        missing = [m for m in order[key] if m not in members]
        if missing:
            raise ValueError(f"{key}: missing {missing} projections among the published weights")
        out[key] = sglang_checksum(torch.cat([members[m] for m in order[key]], dim=0))
    return out
