import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from miles_rollout.tasks.arithmetic import build_char_tokenizer


def save_tiny_qwen2(folder, tokenizer, max_positions: int = 1024):
    """A random tiny Qwen2 sized to `tokenizer`, saved with it as an HF folder."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_qwen2():
    """`save_tiny_qwen2`, for tests that bring their own tokenizer."""
    return save_tiny_qwen2


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Qwen2 with the arithmetic character tokenizer, saved as an HF folder."""
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"), build_char_tokenizer())
