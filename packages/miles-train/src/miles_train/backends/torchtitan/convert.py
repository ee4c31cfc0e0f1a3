"""HF Qwen2 / Qwen3 / Llama config → a torchtitan model config, and the HF state-dict adapter.

torchtitan 0.3 has no Qwen2 model; Qwen2 is Qwen3 without the q/k RMSNorm and with biases on the
q, k and v projections, and Llama (default RoPE) is Qwen3 without either. So every family is assembled
from torchtitan's Qwen3 parts (`Qwen3Model`, `Qwen3TransformerBlock`, `GQAttention` with separate
q/k/v `QKVLinear`, `CosSinRoPE` — the rotate-half RoPE of HF —, SDPA causal attention), and its
`Qwen3StateDictAdapter` learns the bias names.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch.nn as nn

from miles_train.backends.hf_family import check_rebuildable, has_qk_norm, has_qkv_bias, head_dim, rope_parameters


def check_supported(hf_config: Any, tp: int) -> None:
    """Raise UnsupportedModel unless torchtitan's rebuilt model honours `hf_config` split over `tp` ranks."""
    check_rebuildable(hf_config, "torchtitan", tp, ("num_attention_heads", "num_key_value_heads", "intermediate_size"))


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
            feed_forward=FeedForward.Config(
                w1=linear(dim, hf_config.intermediate_size),
                w2=linear(hf_config.intermediate_size, dim),
                w3=linear(dim, hf_config.intermediate_size),
            ),
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


def state_dict_adapter(config: Any):
    """torchtitan's Qwen3 HF adapter, taught the q/k/v bias names of Qwen2."""
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    class Qwen2StateDictAdapter(Qwen3StateDictAdapter):
        def __init__(self, model_config: Any) -> None:
            super().__init__(model_config, None)
            for proj, name in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv")):
                key = f"model.layers.{{}}.self_attn.{proj}.bias"
                self.from_hf_map[key] = f"layers.{{}}.attention.qkv_linear.{name}.bias"

    return Qwen2StateDictAdapter(config)
