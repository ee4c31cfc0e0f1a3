import pytest

from miles_control.testing.tiny_models import save_tiny_model, tiny_model
from miles_rollout.tasks.arithmetic import build_char_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Qwen2 with the arithmetic character tokenizer, saved as an HF folder."""
    tokenizer = build_char_tokenizer()
    config = tiny_model("qwen2", tokenizer=tokenizer, max_position_embeddings=1024)
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), config, tokenizer=tokenizer)
