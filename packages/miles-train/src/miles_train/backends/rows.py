"""Rows and gathers: which rows of a batch a data-parallel rank trains on, the whole batch's values from every
rank's rows, reductions over the data-parallel group, and a check every rank agrees on before any goes on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from miles_train.loss import ObjectiveError
from miles_train.types import TrainBatch


def my_rows(dp_rank: int, dp_size: int, num_rows: int) -> list[int]:
    """The rows data-parallel rank `dp_rank` trains on: `dp_rank::dp_size` (tensor-parallel peers take the same)."""
    return list(range(dp_rank, num_rows, dp_size))


def gather_rows(world_size: int, batch: TrainBatch, rows: list[int], part: torch.Tensor) -> torch.Tensor:
    """[B, T-1] of the whole batch from each data-parallel rank's `rows` of it (`part`, [len(rows), ≤ T-1]),
    identical on every rank."""
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (rows, part.cpu()))  # tensor-parallel peers send the same rows
    width = max(len(ids) for ids in batch.input_ids) - 1
    full = torch.zeros((len(batch), width))
    for part_rows, values in gathered:
        full[part_rows, : values.shape[1]] = values
    return full


def all_reduce(values: list[float], device: Any, group: Any, op: Any = dist.ReduceOp.SUM) -> list[float]:
    """`values` reduced over `group` (None: every rank), in float64."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def agreed(world_size: int, check: Callable[[], Any]) -> Any:
    """`check()`, with every rank agreeing on its outcome before any goes on: a rank whose rows fail it must not
    leave the others waiting in the backward's collectives. Every rank raises the failing rank's message."""
    try:
        value, message = check(), ""
    except ObjectiveError as exc:
        value, message = None, str(exc)
    messages: list = [None] * world_size
    dist.all_gather_object(messages, message)
    failed = next((m for m in messages if m), "")
    if failed:
        raise ObjectiveError(failed)
    return value


def quantile(world_size: int, dp_rank: int, parts: list[torch.Tensor], q: float) -> float:
    """The `q` quantile of the values all data-parallel ranks collected (tensor-parallel peers hold the same)."""
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (dp_rank, torch.cat(parts) if parts else torch.zeros(0)))
    values = torch.cat(list(dict(gathered).values()))  # keyed by data-parallel rank: each token once
    return float(torch.quantile(values.double(), q)) if values.numel() else 0.0
