"""The supervised warm start stops when asked to (the built-in model's accuracy target)."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from miles_train.sft import supervised_finetune


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)  # fmt: skip
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
