"""Supervised fine-tuning of an HF causal LM on (prompt, completion) pairs, in one process.

Used for warm starts: RL needs a policy that succeeds sometimes, not never.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch


def supervised_finetune(
    model: torch.nn.Module,
    examples: list[tuple[list[int], list[int]]],
    num_steps: int,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    pad_token_id: int = 0,
    on_step: Callable[[int, float], None] | None = None,
    done: Callable[[], bool] | None = None,
    check_every: int = 20,
) -> float:
    """Train on completion tokens only (prompt tokens are context). Returns the last loss. With `done`, stop
    early once it returns True (asked every `check_every` steps, and before the first)."""
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
        width = max(len(p) + len(c) for p, c in chosen)
        ids = torch.full((batch_size, width), pad_token_id, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        attention = torch.zeros((batch_size, width), dtype=torch.long)
        for row, (prompt, completion) in enumerate(chosen):
            seq = prompt + completion
            ids[row, : len(seq)] = torch.tensor(seq)
            attention[row, : len(seq)] = 1
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
