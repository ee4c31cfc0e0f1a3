"""The HF model families the megatron and torchtitan backends rebuild (Qwen2/2.5, Qwen3, Llama, and Mistral
without a sliding window: Llama's layer under another model_type), and what of their configs those rebuilds cover. Anything else is refused with the config.json field that
asks for it, rather than giving a model that silently drops weights or computes something else."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

SUPPORTED = ("qwen2", "qwen3", "llama", "mistral")


class UnsupportedModel(ValueError):
    """A model config asks for something a backend does not rebuild; the message names the config field."""


def rope_parameters(hf_config: Any) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if "rope_theta" not in params and hasattr(hf_config, "rope_theta"):  # transformers 4.x
        params = {"rope_theta": hf_config.rope_theta, **(getattr(hf_config, "rope_scaling", None) or {})}
    return params


def head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def has_qkv_bias(hf_config: Any) -> bool:
    """Qwen2 has biases on q, k and v (and nowhere else)."""
    return hf_config.model_type == "qwen2"


def has_qk_norm(hf_config: Any) -> bool:
    """Qwen3 normalises each query and key head (RMSNorm over the head dimension) before RoPE."""
    return hf_config.model_type == "qwen3"


def unsupported_fields(hf_config: Any) -> list[tuple[str, Any, str]]:
    """(field, value, why) for every config.json setting the rebuilt models would not honour."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED:
        return [("model_type", model_type, f"the rebuilt families are {', '.join(SUPPORTED)}")]
    found = []
    experts = next((n for n in ("num_experts", "num_local_experts") if getattr(hf_config, n, None)), None)
    if experts:
        found.append((experts, getattr(hf_config, experts), "mixture-of-experts layers are not rebuilt"))
    if model_type != "qwen2" and getattr(hf_config, "attention_bias", False):  # Qwen2's q/k/v biases are rebuilt
        found.append(("attention_bias", True, "attention projections without biases only"))
    if getattr(hf_config, "mlp_bias", False):
        found.append(("mlp_bias", True, "MLP projections without biases only"))
    if getattr(hf_config, "use_sliding_window", False):
        found.append(("use_sliding_window", True, "full causal attention only"))
    window = getattr(hf_config, "sliding_window", None) if model_type == "mistral" else None
    if window is not None and window < hf_config.max_position_embeddings:  # Mistral v0.1: 4096 of 32768
        found.append(("sliding_window", window, "full causal attention only"))
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        found.append(("hidden_act", hf_config.hidden_act, "SwiGLU (silu) only"))
    rope_type = rope_parameters(hf_config).get("rope_type", "default")
    if rope_type not in (None, "default"):
        found.append(("rope_parameters.rope_type", rope_type, "RoPE without scaling only"))
    if hf_config.num_attention_heads % hf_config.num_key_value_heads:
        found.append(("num_key_value_heads", hf_config.num_key_value_heads, "it must divide num_attention_heads"))
    return found


def check_family(hf_config: Any, backend: str) -> None:
    """Raise UnsupportedModel naming the first config.json field the rebuilt model would not honour."""
    found = unsupported_fields(hf_config)
    if found:
        field, value, why = found[0]
        raise UnsupportedModel(f"{backend} backend: config.json {field}: {value!r} is not supported ({why})")


def check_rebuildable(hf_config: Any, backend: str, tp: int, split: tuple[str, ...]) -> None:
    """`check_family`, then that `tp` (tensor_parallel_size) divides each config.json field in `split` (what the
    backend splits over its tensor-parallel ranks)."""
    check_family(hf_config, backend)
    for name in split:
        if getattr(hf_config, name) % tp:
            raise UnsupportedModel(
                f"{backend} backend: tensor_parallel_size {tp} must divide config.json {name} "
                f"({getattr(hf_config, name)})"
            )


def load_checked_config(model_path: str | Path, check: Callable[[Any, int], None], tp: int) -> Any:
    """The HF config of a model folder, after the backend's `check(hf_config, tp)` (which raises UnsupportedModel)."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(model_path))
    check(hf_config, tp)
    return hf_config
