import pytest

from miles_control.testing.tiny_models import save_tiny_model, tiny_model

# Beyond the factory's widths; its vocabulary (19) is odd, so TP=2 layouts pad it.
SHARED_FIELDS = {"eos_token_id": 1, "pad_token_id": 0, "max_position_embeddings": 64}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Qwen2 (q/k/v biases, untied head) saved as an HF folder."""
    config = tiny_model("qwen2", **SHARED_FIELDS)
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-train"), config, seed=0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A random tiny Llama with tied embeddings (no biases anywhere; the head is the embedding)."""
    config = tiny_model("llama", tie_word_embeddings=True, **SHARED_FIELDS)
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama-tied"), config, seed=1)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """A random tiny Qwen3: per-head q/k RMSNorm (replicated over TP ranks, fed by split heads), head_dim wider
    than hidden / heads, tied embeddings."""
    config = tiny_model("qwen3", **SHARED_FIELDS)
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), config, seed=2)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory):
    """A random tiny Qwen3-MoE: 4 experts, top-2 renormalised, untied head (the experts fused in transformers'
    modules, per expert in the checkpoint)."""
    config = tiny_model("qwen3_moe", **SHARED_FIELDS)
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), config, seed=3)


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory):
    """A random tiny Mixtral: Llama's attention, 4 experts `block_sparse_moe.experts.<j>.w1/w3/w2`, top-2."""
    config = tiny_model("mixtral", **SHARED_FIELDS)
    return save_tiny_model(tmp_path_factory.mktemp("tiny-mixtral"), config, seed=4)
