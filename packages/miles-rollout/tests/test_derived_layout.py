"""Issue 55, item 1: SGLang's weight layout derived from what a server reports, not from a table of families. Here
the server's checksums are the table's (layout.py, checked bit-exact against real servers for its families): the
derived recipes must give the same checksums for any later version of the weights, and refuse what they cannot
build. tests/test_model_matrix.py runs the derivation against real SGLang servers for families outside the table."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles_control.testing.tiny_models import tiny_model
from miles_rollout.engines.sglang.derived_layout import LayoutError, derive_layout, expected_by_recipes
from miles_rollout.engines.sglang.layout import expected_checksums


def checkpoint(family: str, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_model(family, vocab_size=19, pad_token_id=0))
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi3", "olmo2", "qwen3_moe", "mixtral"])
def test_the_derived_layout_agrees_with_the_table_on_every_later_version(family):
    tensors = checkpoint(family, 0)
    server = expected_checksums(tensors.items())  # what a server holding the checkpoint reports
    recipes = derive_layout(tensors, server)
    assert expected_by_recipes(recipes, tensors) == server
    later = {name: t + 0.01 * torch.randn_like(t) for name, t in tensors.items()}  # a trained version: all differ
    assert expected_by_recipes(recipes, later) == expected_checksums(later.items())


def test_zero_biases_fuse_in_the_order_of_their_weights():
    """Freshly initialised q/k/v biases are all zero: any order reproduces them; only the weights' order is right
    once they train."""
    tensors = checkpoint("qwen2", 1)
    for name in tensors:
        if name.endswith("_proj.bias"):
            tensors[name].zero_()
    recipes = derive_layout(tensors, expected_checksums(tensors.items()))
    bias = recipes["model.layers.0.self_attn.qkv_proj.bias"]
    assert [s.split(".")[-2] for s in bias.sources] == ["q_proj", "k_proj", "v_proj"]


def test_a_parameter_no_recipe_builds_is_named():
    tensors = checkpoint("qwen2", 2)
    server = expected_checksums(tensors.items())
    server["model.layers.0.self_attn.qkv_proj.weight"] = "0" * 16  # a layout miles does not know
    with pytest.raises(LayoutError, match=r"1 of the server's \d+ parameters .* e.g. \['model.layers.0.self_attn"):
        derive_layout(tensors, server)
