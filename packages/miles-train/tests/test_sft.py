"""The supervised warm start stops when asked to (the built-in model's accuracy target)."""

import pytest
import torch
from transformers import Qwen2ForCausalLM

from miles_control.testing import tiny_models
from miles_train.sft import supervised_finetune


def tiny_model() -> torch.nn.Module:
    """A random one-layer Qwen2 (seed 0)."""
    config = tiny_models.tiny_model(
        "qwen2", vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def test_done_is_asked_every_few_steps_and_stops_the_run():
    examples = [([1, 2, 3], [4, 5]), ([2, 3], [6])]
    asked_at: list[int] = []
    steps: list[int] = []

    def done() -> bool:
        asked_at.append(len(steps))
        return len(steps) >= 10

    supervised_finetune(tiny_model(), examples, 100, batch_size=2, on_step=lambda s, _: steps.append(s), done=done,
                        check_every=5)  # fmt: skip
    assert asked_at == [0, 5, 10] and len(steps) == 10  # asked before steps 0, 5 and 10; stopped at 10
    steps.clear()
    supervised_finetune(tiny_model(), examples, 7, batch_size=2, on_step=lambda s, _: steps.append(s))
    assert len(steps) == 7  # without `done`: every step


def test_a_completion_mask_leaves_tokens_out_of_the_loss():
    """Masked-out completion tokens (a tool's answer in a demonstrated episode) are context: the model learns the
    tokens around them, not them."""
    import torch.nn.functional as F

    # prompt [1]; completion 2 3 4 5, where 3 and 4 play the environment's turn (mask 0).
    trained = tiny_model()
    supervised_finetune(trained, [([1], [2, 3, 4, 5], [1, 0, 0, 1])], 60, batch_size=4, lr=1e-2)
    with torch.no_grad():
        logprobs = F.log_softmax(trained(input_ids=torch.tensor([[1, 2, 3, 4, 5]])).logits[0], dim=-1)
    # Position i predicts token i+1: 2 (after 1) and 5 (after 4) were trained; 3 and 4 were not.
    learned = [logprobs[0, 2].exp().item(), logprobs[3, 5].exp().item()]
    untrained = [logprobs[1, 3].exp().item(), logprobs[2, 4].exp().item()]
    assert min(learned) > 0.9 and max(untrained) < 0.5, (learned, untrained)
    with pytest.raises(ValueError, match="example 0: a mask of 1 for 2 completion tokens"):
        supervised_finetune(tiny_model(), [([1], [2, 3], [1])], 1)
    for mask in ([0, 0], [1, 2]):  # nothing to learn (a NaN loss), or not a mask
        with pytest.raises(ValueError, match="example 0: a mask of 0s and 1s with at least one 1"):
            supervised_finetune(tiny_model(), [([1], [2, 3], mask)], 1)


def test_the_warm_start_trains_the_sft_objective_hf_s_own_loss():
    """The warm start's loss is the `sft` objective's, aggregated as a job's trainer does: on a batch with masks it
    equals the mean cross-entropy transformers computes over the same trained tokens."""
    from miles_train.objectives import build_objective
    from miles_train.sft import AlgorithmConfig, _sft_loss, as_batch

    model = tiny_model()
    examples = [([1, 2, 3], [4, 5, 6], [1, 0, 1]), ([2, 3], [6, 7])]
    loss = _sft_loss(model, build_objective(AlgorithmConfig(name="sft")), as_batch(examples), pad_token_id=0)
    width = 6
    ids = torch.zeros((2, width), dtype=torch.long)
    labels = torch.full((2, width), -100, dtype=torch.long)
    attention = torch.zeros((2, width), dtype=torch.long)
    for row, (prompt, completion, *mask) in enumerate(examples):
        seq = prompt + completion
        ids[row, : len(seq)], attention[row, : len(seq)] = torch.tensor(seq), 1
        kept = [t if m else -100 for t, m in zip(completion, mask[0] if mask else [1] * len(completion), strict=True)]
        labels[row, len(prompt) : len(seq)] = torch.tensor(kept)
    expected = model(input_ids=ids, attention_mask=attention, labels=labels).loss
    assert torch.allclose(loss, expected, atol=1e-6), (float(loss), float(expected))
    loss.backward()  # and it trains: a gradient reaches the weights
    assert model.model.embed_tokens.weight.grad is not None
