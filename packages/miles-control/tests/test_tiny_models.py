"""The tiny-model factory the tests, the architecture matrix and the benchmarks share."""

import json

import pytest
from transformers import AutoConfig

from miles_control.testing.tiny_models import FAMILIES, TINY, save_tiny_model, tiny_model
from miles_rollout.tasks.arithmetic import build_char_tokenizer


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_has_the_tiny_widths_and_its_own_fields(family):
    config = tiny_model(family)
    layers = FAMILIES[family][1].get("num_hidden_layers", 2)  # DeepSeek-V3: a dense layer, then two with experts
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (32, layers, TINY["vocab_size"])
    for field, value in FAMILIES[family][1].items():
        assert getattr(config, field) == value


def test_overrides_and_a_tokenizer_win_over_the_defaults():
    tokenizer = build_char_tokenizer()
    config = tiny_model("llama", tokenizer=tokenizer, tie_word_embeddings=True, hidden_size=16)
    assert (config.vocab_size, config.eos_token_id, config.pad_token_id) == (len(tokenizer), 1, 0)
    assert config.tie_word_embeddings and config.hidden_size == 16
    assert not hasattr(tiny_model("gpt2"), "num_key_value_heads")  # a field GPT-2 does not take is left out
    with pytest.raises(ValueError, match="unknown model family 'mamba'"):
        tiny_model("mamba")


def test_a_saved_model_is_written_once(tmp_path):
    tokenizer = build_char_tokenizer()
    folder = save_tiny_model(tmp_path / "m", tiny_model("qwen3", tokenizer=tokenizer), tokenizer=tokenizer)
    assert AutoConfig.from_pretrained(folder).model_type == "qwen3"
    assert (folder / "tokenizer.json").exists() and not (tmp_path / "m.partial").exists()
    written = (folder / "model.safetensors").stat().st_mtime_ns
    assert save_tiny_model(folder, tiny_model("llama")) == folder  # already there: returned as it is
    assert (folder / "model.safetensors").stat().st_mtime_ns == written
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3"
