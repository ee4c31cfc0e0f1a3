"""Supervised fine-tuning of an HF causal LM on (prompt, completion) pairs, in one process.

Used for warm starts: RL needs a policy that succeeds sometimes, not never. A completion may carry a per-token
mask (an episode: the model's turns trained, the environment's turns context only). The loss is the `sft`
objective's (`train.algorithm: sft`, objectives.py), aggregated over the batch's trained tokens as a job's trainer
aggregates it (`loss.aggregate`, token_mean): a warm start and an SFT job train the same quantity.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from miles_train.algorithm_config import AlgorithmConfig
from miles_train.collate import collate, token_logprobs
from miles_train.loss import LossInputs, aggregate
from miles_train.objectives import Objective, build_objective
from miles_train.types import TrainBatch

# (prompt, completion) or (prompt, completion, mask); a prompt is its ids, or (ids, multimodal inputs) for a prompt
# with images (a vision-language model's processor inputs, as `PromptEncoder.inputs` gives them)
Example = tuple[Any, list[int]] | tuple[Any, list[int], list[int]]


def _prompt(example: Example) -> tuple[list[int], dict | None]:
    prompt = example[0]
    with_images = isinstance(prompt, tuple) and len(prompt) == 2 and isinstance(prompt[1], dict | None)
    return (list(prompt[0]), prompt[1]) if with_images else (list(prompt), None)


def as_batch(examples: Sequence[Example]) -> TrainBatch:
    """Demonstrations as the trainer's batch: each completion is a response, its mask (all 1s by default) the
    tokens trained; no rewards, no engine logprobs."""
    prompts = [_prompt(e) for e in examples]
    return TrainBatch(
        input_ids=[ids + list(e[1]) for (ids, _), e in zip(prompts, examples, strict=True)],
        response_start=[len(ids) for ids, _ in prompts],
        rollout_logprobs=[[0.0] * len(e[1]) for e in examples],
        loss_mask=[list(e[2]) if len(e) == 3 else [1] * len(e[1]) for e in examples],
        rewards=[0.0] * len(examples),
        group_index=list(range(len(examples))),
        multimodal=[mm for _, mm in prompts] if any(mm for _, mm in prompts) else None,
    )


def _sft_loss(model: torch.nn.Module, objective: Objective, batch: TrainBatch, pad_token_id: int) -> torch.Tensor:
    """The `sft` objective's loss of `batch` under `model`: −log π of every trained token, their mean."""
    c = collate(batch, pad_token_id)
    logprobs, _ = token_logprobs(model, c)
    mask = c.loss_mask
    zeros = torch.zeros_like(logprobs)
    per_token, _ = objective.policy_loss(LossInputs(logprobs, logprobs.detach(), zeros, mask, 0.0, 0.0))
    return aggregate(per_token, mask, "token_mean", float(mask.sum()), float((mask.sum(1) > 0).sum()))


def supervised_finetune(
    model: torch.nn.Module,
    examples: Sequence[Example],
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
    `(prompt, completion, mask)` (a prompt with images: `((ids, multimodal), ...)`), the mask one 0/1 per completion token (0: context, e.g. a tool's answer inside
    a demonstrated episode). Returns the last loss. With `done`, stop early once it returns True (asked every
    `check_every` steps, and before the first)."""
    for index, example in enumerate(examples):
        if len(example) == 3:
            mask = example[2]
            if len(mask) != len(example[1]):
                raise ValueError(f"example {index}: a mask of {len(mask)} for {len(example[1])} completion tokens")
            if not set(mask) <= {0, 1} or 1 not in mask:
                raise ValueError(f"example {index}: a mask of 0s and 1s with at least one 1, not {mask[:20]}")
    objective = build_objective(AlgorithmConfig(name="sft"))
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
        loss = _sft_loss(model, objective, as_batch(chosen), pad_token_id)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if on_step is not None:
            on_step(step, loss_value)
    model.eval()
    return loss_value
