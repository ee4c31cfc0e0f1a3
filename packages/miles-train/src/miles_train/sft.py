"""Supervised fine-tuning of an HF causal LM on (prompt, completion) pairs, in one process.

Used for warm starts: RL needs a policy that succeeds sometimes, not never. A completion may carry a per-token
mask (an episode: the model's turns trained, the environment's turns context only).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch


def supervised_finetune(
    model: torch.nn.Module,
    examples: Sequence[tuple[list[int], list[int]] | tuple[list[int], list[int], list[int]]],
    num_steps: int,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    pad_token_id: int = 0,
    on_step: Callable[[int, float], None] | None = None,
    done: Callable[[], bool] | None = None,
    check_every: int = 20,
) -> float:
    """Train on completion tokens only (prompt tokens are context). An example is `(prompt, completion)` or
    `(prompt, completion, mask)`, the mask one 0/1 per completion token (0: context, e.g. a tool's answer inside
    a demonstrated episode). Returns the last loss. With `done`, stop early once it returns True (asked every
    `check_every` steps, and before the first)."""
    for index, example in enumerate(examples):
        if len(example) == 3:
            mask = example[2]
            if len(mask) != len(example[1]):
                raise ValueError(f"example {index}: a mask of {len(mask)} for {len(example[1])} completion tokens")
            if not set(mask) <= {0, 1} or 1 not in mask:
                raise ValueError(f"example {index}: a mask of 0s and 1s with at least one 1, not {mask[:20]}")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss_value = float("nan")
    for step in range(num_steps):
        if done is not None and step % check_every == 0:
            model.eval()
            finished = done()
            model.train()
            if finished:
                break
        chosen = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        width = max(len(e[0]) + len(e[1]) for e in chosen)
        ids = torch.full((batch_size, width), pad_token_id, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        attention = torch.zeros((batch_size, width), dtype=torch.long)
        for row, example in enumerate(chosen):
            prompt, completion = example[0], example[1]
            seq = prompt + completion
            ids[row, : len(seq)] = torch.tensor(seq)
            attention[row, : len(seq)] = 1
            if len(example) == 3:  # masked-out tokens are context, like the prompt
                completion = [t if m else -100 for t, m in zip(completion, example[2], strict=True)]
            labels[row, len(prompt) : len(seq)] = torch.tensor(completion)
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if on_step is not None:
            on_step(step, loss_value)
    model.eval()
    return loss_value
