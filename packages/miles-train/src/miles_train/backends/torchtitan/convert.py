"""HF Qwen2 / Qwen3 / Llama / Qwen3-MoE / Mixtral config → a torchtitan model config, and the HF state-dict adapter.

torchtitan 0.3 has no Qwen2 model; Qwen2 is Qwen3 without the q/k RMSNorm and with biases on the
q, k and v projections, and Llama (default RoPE) is Qwen3 without either. So every family is assembled
from torchtitan's Qwen3 parts (`Qwen3Model`, `Qwen3TransformerBlock`, `GQAttention` with separate
q/k/v `QKVLinear`, `CosSinRoPE` — the rotate-half RoPE of HF —, SDPA causal attention), and its
`Qwen3StateDictAdapter` learns the bias names.

A mixture of experts is torchtitan's own MoE (`MoE`: `TokenChoiceTopKRouter` with softmax scores, renormalised as
the config says, no load-balancing bias; `GroupedExperts` holding each layer's experts stacked, `w1`/`w3`/`w2` =
gate/up/down; the scores weigh the experts' outputs, as transformers does). torchtitan's `GroupedExperts` always
computes in bf16 (its grouped GEMM kernels); miles' `ExpertsInParamDtype` computes the same grouped GEMMs in the
parameters' dtype, so fp32 training is fp32 (and bf16 under `train.precision: bf16`). The Qwen3 adapter stacks and
splits the checkpoint's per-expert tensors; Mixtral's names (`block_sparse_moe.experts.<j>.w1/w3/w2`, its `gate`) are
Qwen3-MoE's under another name.

`train.lora`: PEFT injects the adapter into torchtitan's own linear modules (in place, before the model is
parallelised on the meta device), and the adapter travels and is saved under the names PEFT gives it on the HF
model, so engines, checkpoints and `miles export` read it as they read an fsdp2 adapter. torchtitan's modules and the
HF projections they hold: `attention.qkv_linear.wq/wk/wv` ↔ `self_attn.q_proj/k_proj/v_proj`, `attention.wo` ↔
`self_attn.o_proj`, `feed_forward.w1/w3/w2` ↔ `mlp.gate_proj/up_proj/down_proj`; `train.lora.target_modules` names
the HF projections.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from miles_train import lora
from miles_train.backends.hf_family import (
    check_rebuildable,
    has_qk_norm,
    has_qkv_bias,
    head_dim,
    moe_ffn_size,
    num_experts,
    rope_parameters,
)


def check_supported(hf_config: Any, tp: int) -> None:
    """Raise UnsupportedModel unless torchtitan's rebuilt model honours `hf_config` split over `tp` ranks."""
    check_rebuildable(hf_config, "torchtitan", tp, ("num_attention_heads", "num_key_value_heads"))


def _experts_class():
    """torchtitan's GroupedExperts computing in its parameters' dtype (torchtitan's own casts to bf16)."""
    from torch.distributed.tensor import DTensor
    from torchtitan.models.common.moe import GroupedExperts

    class ExpertsInParamDtype(GroupedExperts):
        """The grouped SwiGLU experts: per expert e, (silu(x W1ₑᵀ) · x W3ₑᵀ) W2ₑᵀ over its tokens (grouped GEMMs)."""

        @dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            pass

        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            w1, w2, w3 = (
                w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
            )
            offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            x = x_RD.to(w1.dtype)
            gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets)
            up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
            out = torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)
            return out.type_as(x_RD)

    return ExpertsInParamDtype


def _moe(hf_config: Any, linear: Any) -> Any:
    """torchtitan's MoE config of a Qwen3-MoE / Mixtral layer, as transformers computes it."""
    from torchtitan.models.common.moe import MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    n, k, dim = num_experts(hf_config), hf_config.num_experts_per_tok, hf_config.hidden_size
    renormalise = hf_config.model_type == "mixtral" or bool(getattr(hf_config, "norm_topk_prob", True))
    init = partial(nn.init.normal_, std=0.02)
    return MoE.Config(
        num_experts=n,
        load_balance_coeff=None,  # no load-balancing bias on the scores: transformers has none
        router=TokenChoiceTopKRouter.Config(
            num_experts=n, gate=linear(dim, n), top_k=k, score_func="softmax", route_norm=renormalise
        ),
        routed_experts=RoutedExperts.Config(
            inner_experts=_experts_class().Config(
                dim=dim,
                hidden_dim=moe_ffn_size(hf_config),
                num_experts=n,
                param_init={"w1_EFD": init, "w2_EDF": init, "w3_EFD": init},
            ),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=n, top_k=k),  # local without expert parallel
        ),
    )


def model_config(hf_config: Any, vocab_size: int | None = None):
    """The torchtitan `Qwen3Model.Config` equal to an HF Qwen2/Qwen3/Llama config (with the vocabulary
    padded to `vocab_size` rows when given)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import GQAttention, QKVLinear, ScaledDotProductAttention
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

    dim, hd = hf_config.hidden_size, head_dim(hf_config)
    nh, nkv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    bias = has_qkv_bias(hf_config)
    vocab = vocab_size or hf_config.vocab_size
    # Weights come from the checkpoint; the initialisers only give meta-built modules defined values.
    linear_init = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}

    def linear(fan_in: int, fan_out: int, with_bias: bool = False) -> Linear.Config:
        return Linear.Config(in_features=fan_in, out_features=fan_out, bias=with_bias, param_init=linear_init)

    def norm(size: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=size, eps=hf_config.rms_norm_eps, param_init={"weight": nn.init.ones_})

    rope = CosSinRoPE.Config(
        dim=hd,
        max_seq_len=hf_config.max_position_embeddings,
        theta=float(rope_parameters(hf_config).get("rope_theta", 10000.0)),
    )
    layers = [
        Qwen3TransformerBlock.Config(
            attention_norm=norm(dim),
            ffn_norm=norm(dim),
            attention=GQAttention.Config(
                n_heads=nh,
                n_kv_heads=nkv,
                head_dim=hd,
                dim=dim,
                qkv_linear=QKVLinear.Config(
                    head_dim=hd, wq=linear(dim, nh * hd, bias), wkv=linear(dim, nkv * hd, bias)
                ),
                wo=linear(nh * hd, dim),
                qk_norm=norm(hd) if has_qk_norm(hf_config) else None,
                inner_attention=ScaledDotProductAttention.Config(),  # causal; rows are right-padded
                rope=rope,
            ),
            feed_forward=None
            if num_experts(hf_config)
            else FeedForward.Config(
                w1=linear(dim, hf_config.intermediate_size),
                w2=linear(hf_config.intermediate_size, dim),
                w3=linear(dim, hf_config.intermediate_size),
            ),
            moe=_moe(hf_config, linear) if num_experts(hf_config) else None,
        )
        for _ in range(hf_config.num_hidden_layers)
    ]
    return Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=norm(dim),
        enable_weight_tying=bool(getattr(hf_config, "tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init={"weight": nn.init.normal_}
        ),
        lm_head=linear(dim, vocab),
        layers=layers,
    )


# Mixtral's checkpoint names of a layer's mixture of experts → Qwen3-MoE's (what torchtitan's adapter knows)
_MIXTRAL = [
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."),
    (re.compile(r"\.block_sparse_moe\.gate\."), r".mlp.gate."),
]
_QWEN3_MOE = [
    (re.compile(r"\.mlp\.experts\.(\d+)\.gate_proj\."), r".block_sparse_moe.experts.\1.w1."),
    (re.compile(r"\.mlp\.experts\.(\d+)\.up_proj\."), r".block_sparse_moe.experts.\1.w3."),
    (re.compile(r"\.mlp\.experts\.(\d+)\.down_proj\."), r".block_sparse_moe.experts.\1.w2."),
    (re.compile(r"\.mlp\.gate\."), r".block_sparse_moe.gate."),
]


def _renamed(tensors: dict[str, Any], rules: list) -> dict[str, Any]:
    out = {}
    for name, tensor in tensors.items():
        for pattern, replacement in rules:
            name = pattern.sub(replacement, name)
        out[name] = tensor
    return out


def state_dict_adapter(config: Any, model_type: str = "qwen3"):
    """torchtitan's Qwen3 HF adapter, taught the q/k/v bias names of Qwen2 and, for `model_type` mixtral, Mixtral's
    expert names."""
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    class Qwen2StateDictAdapter(Qwen3StateDictAdapter):
        def __init__(self, model_config: Any) -> None:
            super().__init__(model_config, None)
            for proj, name in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv")):
                key = f"model.layers.{{}}.self_attn.{proj}.bias"
                self.from_hf_map[key] = f"layers.{{}}.attention.qkv_linear.{name}.bias"

        def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
            if model_type == "mixtral":
                hf_state_dict = _renamed(hf_state_dict, _MIXTRAL)
            return super().from_hf(hf_state_dict)

        def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            hf = super().to_hf(state_dict)
            return _renamed(hf, _QWEN3_MOE) if model_type == "mixtral" else hf

    return Qwen2StateDictAdapter(config)


# ---- train.lora -----------------------------------------------------------------------------------------
# torchtitan module (within a layer) → the HF module it holds (within a layer)
LORA_MODULES = {
    "attention.qkv_linear.wq": "self_attn.q_proj",
    "attention.qkv_linear.wk": "self_attn.k_proj",
    "attention.qkv_linear.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
_LORA_HF_LEAF = {hf.rsplit(".", 1)[1]: tt for tt, hf in LORA_MODULES.items()}  # q_proj → attention.qkv_linear.wq
_LORA_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def lora_peft_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """PEFT's LoraConfig arguments for torchtitan's model: the HF projections of `target_modules` as the torchtitan
    modules that hold them (full paths within a layer, so `w1` matches no other module). Refuses a name torchtitan's
    model has no module for, naming the field."""
    unknown = [name for name in kwargs["target_modules"] if name not in _LORA_HF_LEAF]
    if unknown:
        raise ValueError(
            f"train.lora.target_modules {unknown}: torchtitan's model has no such projection (it adapts "
            f"{', '.join(_LORA_HF_LEAF)})"
        )
    return {**kwargs, "target_modules": [_LORA_HF_LEAF[name] for name in kwargs["target_modules"]]}


def inject_lora(model: torch.nn.Module, kwargs: dict[str, Any]) -> torch.nn.Module:
    """The adapter injected into `model` in place (PEFT's `inject_adapter_in_model`): the base frozen, the adapted
    linears now PEFT layers with `base_layer`, `lora_A.default` and `lora_B.default`. On the meta device: the
    values come with the checkpoint (`with_lora`)."""
    from peft import LoraConfig, inject_adapter_in_model

    return inject_adapter_in_model(LoraConfig(**lora_peft_kwargs(kwargs)), model)


def lora_hf_module(module: str) -> str:
    """A torchtitan module path (`layers.3.attention.wo`) → the HF module it holds (`model.layers.3.self_attn.o_proj`)."""
    match = _LORA_LAYER.match(module)
    if match is None or match.group(2) not in LORA_MODULES:
        raise ValueError(f"{module}: not a torchtitan module a LoRA adapter maps to an HF projection")
    return f"model.layers.{match.group(1)}.{LORA_MODULES[match.group(2)]}"


def lora_wire_names(model: torch.nn.Module) -> dict[str, str]:
    """The adapter's parameters of `model` (torchtitan names) → their wire names: PEFT's save names on the HF model."""
    names = {}
    for name, _ in model.named_parameters():
        if lora.is_adapter(name):
            module, _, matrix = name.partition(".lora_")  # layers.0.attention.wo, A.default.weight
            names[name] = lora.wire_name(f"{lora.PEFT_PREFIX}{lora_hf_module(module)}.lora_{matrix}")
    return names


def with_lora(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict of the model without an adapter (`state`) as the injected model's: each adapted linear's
    weight under `<module>.base_layer.weight`, and the adapter's start (A from `lora.initial_a`, B zero)."""
    adapted = {name.rsplit(".lora_", 1)[0] for name in lora_wire_names(model)}
    out = {}
    for name, tensor in state.items():
        module, _, leaf = name.rpartition(".")
        out[f"{module}.base_layer.{leaf}" if module in adapted else name] = tensor
    params = dict(model.named_parameters())
    for name, wire in lora_wire_names(model).items():
        shape = params[name].shape
        out[name] = lora.initial_a(wire, shape) if ".lora_A." in name else torch.zeros(tuple(shape))
    return out
