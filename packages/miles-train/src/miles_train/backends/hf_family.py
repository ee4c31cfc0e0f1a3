"""The HF model families the megatron and torchtitan backends rebuild (Qwen2/2.5, Qwen3, Llama, and Mistral
without a sliding window: Llama's layer under another model_type; and the mixtures of experts Qwen3-MoE and Mixtral),
and what of their configs those rebuilds cover. Anything else is refused with the config.json field that
asks for it, rather than giving a model that silently drops weights or computes something else."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

SUPPORTED = ("qwen2", "qwen3", "llama", "mistral")
# Mixtures of experts: Qwen3's attention (Llama's for Mixtral), every MLP a set of SwiGLU experts behind a softmax
# top-k router, no shared expert
MOE_FAMILIES = ("qwen3_moe", "mixtral")


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
    """Qwen3 (and Qwen3-MoE) normalises each query and key head (RMSNorm over the head dimension) before RoPE."""
    return hf_config.model_type in ("qwen3", "qwen3_moe")


def experts_field(hf_config: Any) -> str | None:
    """The config field holding a mixture of experts' expert count (None for a dense model): not an alias
    (`attribute_map`; transformers 5 keeps `num_local_experts` for Qwen3-MoE too, `num_experts` naming it)."""
    aliases = getattr(type(hf_config), "attribute_map", {})
    names = ("num_experts", "num_local_experts")
    return next((n for n in names if n not in aliases and getattr(hf_config, n, None)), None)


def num_experts(hf_config: Any) -> int:
    field = experts_field(hf_config)
    return int(getattr(hf_config, field)) if field else 0


def moe_ffn_size(hf_config: Any) -> int:
    """One expert's intermediate width (Qwen3-MoE: `moe_intermediate_size`; Mixtral's experts are its
    `intermediate_size`)."""
    return int(getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size)


def _moe_fields(hf_config: Any) -> list[tuple[str, Any, str]]:
    """What of a Qwen3-MoE / Mixtral config the rebuilt mixture of experts does not honour."""
    found = []
    if getattr(hf_config, "mlp_only_layers", None):
        found.append(("mlp_only_layers", hf_config.mlp_only_layers, "every layer a mixture of experts only"))
    if getattr(hf_config, "decoder_sparse_step", 1) != 1:
        found.append(("decoder_sparse_step", hf_config.decoder_sparse_step, "every layer a mixture of experts only"))
    if getattr(hf_config, "router_jitter_noise", 0.0):
        found.append(("router_jitter_noise", hf_config.router_jitter_noise, "routers without jitter only"))
    return found


def unsupported_fields(hf_config: Any) -> list[tuple[str, Any, str]]:
    """(field, value, why) for every config.json setting the rebuilt models would not honour."""
    model_type = getattr(hf_config, "model_type", None)
    families = SUPPORTED + MOE_FAMILIES
    if model_type not in families:
        return [("model_type", model_type, f"the rebuilt families are {', '.join(families)}")]
    found = []
    field = experts_field(hf_config)
    if field and model_type not in MOE_FAMILIES:
        found.append((field, getattr(hf_config, field), "mixture-of-experts layers are not rebuilt"))
    if model_type in MOE_FAMILIES:
        found += _moe_fields(hf_config)
    if model_type != "qwen2" and getattr(hf_config, "attention_bias", False):  # Qwen2's q/k/v biases are rebuilt
        found.append(("attention_bias", True, "attention projections without biases only"))
    if getattr(hf_config, "mlp_bias", False):
        found.append(("mlp_bias", True, "MLP projections without biases only"))
    if getattr(hf_config, "use_sliding_window", False):
        found.append(("use_sliding_window", True, "full causal attention only"))
    window = getattr(hf_config, "sliding_window", None) if model_type in ("mistral", "mixtral") else None
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
    backend splits over its tensor-parallel ranks; a dense model's `intermediate_size` too), and that a mixture of
    experts is not split by `tp` (the backends split experts otherwise, or not at all)."""
    check_family(hf_config, backend)
    field = experts_field(hf_config)
    if not field:
        split = (*split, "intermediate_size")
    elif tp > 1:
        raise UnsupportedModel(
            f"{backend} backend: a mixture of experts (config.json {field}) with tensor_parallel_size {tp}: its "
            "experts are not split by tensor parallelism here (tensor_parallel_size 1"
            + ("; split them over ranks with expert_parallel_size instead)" if backend == "megatron" else ")")
        )
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
