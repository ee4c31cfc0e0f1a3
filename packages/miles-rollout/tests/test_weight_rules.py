"""The weight rules every engine follows: a tied head is sent once, the check compares in the dtype sent."""

import pytest
import torch
from transformers import LlamaForCausalLM

from miles_control.testing.tiny_models import save_tiny_model, tiny_model
from miles_rollout import HFEngineConfig, build_engine
from miles_rollout.engines.checks import held_fingerprint
from miles_sync import DiskSync, build_sender, weight_fingerprint, without_tied_head


@pytest.fixture(scope="module")
def tied_bf16(tmp_path_factory):
    """A tiny Llama as small open models ship: tied head, bf16 weights."""
    config = tiny_model(
        "llama", vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    return save_tiny_model(tmp_path_factory.mktemp("tied-bf16"), config, seed=4, dtype="bfloat16")


def trained(model_dir):
    """What a trainer would publish after a step: fp32 master weights, moved a little."""
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [(n, t + 0.01) for n, t in model.state_dict().items()]


def test_the_hf_engine_runs_the_checkpoint_dtype_and_takes_a_tied_head_once(tied_bf16, tmp_path):
    engine = build_engine(HFEngineConfig(), tied_bf16)
    assert engine.dtype == "bfloat16"  # dtype auto: the checkpoint's
    weights = trained(tied_bf16)
    sender = build_sender(DiskSync(dtype="bfloat16", dir=str(tmp_path)))
    with pytest.raises(ValueError, match=r"unknown weights \['lm_head.weight'\] \(lm_head.weight: the model ties"):
        engine.receive(sender.publish(weights, weight_version=1))
    handle = sender.publish(without_tied_head(weights, tied=True), weight_version=1)
    assert engine.receive(handle) == handle.fingerprint
    assert handle.num_tensors == len(weights) - 1


def test_the_check_compares_in_the_dtype_sent():
    sent = [("w", torch.randn(8, 8).to(torch.bfloat16)), ("steps", torch.tensor(3))]
    # an fp32 engine holds bf16 values exactly: in the dtype sent, its fingerprint is the sender's
    assert held_fingerprint(sent, "float32", "bfloat16") == weight_fingerprint(sent)
    assert held_fingerprint(sent, "float32", None) != weight_fingerprint(sent)
    # a bf16 engine that was sent fp32 values has rounded them: no fingerprint of it can equal the sender's
    fp32 = [("w", torch.randn(8, 8)), ("steps", torch.tensor(3))]
    assert held_fingerprint(fp32, "bfloat16", "float32") != weight_fingerprint(fp32)
