"""Chat templates: prompts rendered the way an Instruct model was trained to see them."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from miles_rollout.data import PromptDataError
from miles_rollout.prompts import PromptEncoder
from miles_rollout.types import PromptRecord

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer with a chat template (the Instruct models' kind, built from code)."""
    words = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "Be", "brief.", "Capital", "of", "France?", "[UNK]"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")
    tok.add_special_tokens({"additional_special_tokens": words[:4]})
    tok.chat_template = TEMPLATE
    return tok


def test_none_encodes_plain_text(tokenizer):
    encoder = PromptEncoder(tokenizer)
    record = PromptRecord("Capital of France?", "Paris")
    assert encoder.text(record) == "Capital of France?"
    assert encoder.encode(record) == tokenizer.encode("Capital of France?")


def test_model_template_renders_a_text_prompt_as_one_user_turn_after_the_system_prompt(tokenizer):
    encoder = PromptEncoder(tokenizer, "model", system_prompt="Be brief.")
    text = encoder.text(PromptRecord("Capital of France?", "Paris"))
    assert text == "<|system|>Be brief.<|end|><|user|>Capital of France?<|end|><|assistant|>"
    ids = encoder.encode(PromptRecord("Capital of France?", "Paris"))
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "<|system|>", "Be", "brief.", "<|end|>", "<|user|>", "Capital", "of", "France?", "<|end|>", "<|assistant|>"
    ]  # fmt: skip


def test_messages_keep_their_own_system_turn(tokenizer):
    encoder = PromptEncoder(tokenizer, "model", system_prompt="ignored")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "France?"}]
    assert encoder.text(PromptRecord("France?", "Paris", messages=messages)).startswith("<|system|>Be brief.")


def test_a_template_file(tokenizer, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("Q: {{ messages[-1]['content'] }} A:")
    assert PromptEncoder(tokenizer, str(path)).text(PromptRecord("France?", "Paris")) == "Q: France? A:"


def test_errors_name_the_setting(tokenizer, tmp_path):
    with pytest.raises(PromptDataError, match="data.chat_template: cannot read"):
        PromptEncoder(tokenizer, str(tmp_path / "missing.jinja"))
    plain = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, unk_token="[UNK]")
    plain.chat_template = None
    with pytest.raises(PromptDataError, match="this model's tokenizer has no chat template"):
        PromptEncoder(plain, "model")
    with pytest.raises(PromptDataError, match="a prompt given as messages needs data.chat_template"):
        PromptEncoder(tokenizer).encode(PromptRecord("x", "y", messages=[{"role": "user", "content": "x"}]))


def test_system_prompt_without_template_is_a_spec_error():
    from pydantic import ValidationError

    from miles_rollout.config import DataConfig

    with pytest.raises(ValidationError, match="system_prompt needs a chat_template"):
        DataConfig(system_prompt="Be brief.")
