import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Qwen2 saved as an HF folder. The vocabulary (19) is odd, so TP=2 layouts pad it."""
    folder = tmp_path_factory.mktemp("tiny-qwen2-train")
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=19,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        eos_token_id=1,
        pad_token_id=0,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A random tiny Llama with tied embeddings (no biases anywhere; the head is the embedding)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama-tied")
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=19,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        eos_token_id=1,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """A random tiny Qwen3: per-head q/k RMSNorm (replicated over TP ranks, fed by split heads), head_dim wider
    than hidden / heads, tied embeddings."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen3")
    torch.manual_seed(2)
    config = Qwen3Config(
        vocab_size=19,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        eos_token_id=1,
        pad_token_id=0,
    )
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder
