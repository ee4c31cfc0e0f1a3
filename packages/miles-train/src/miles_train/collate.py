"""Turn a TrainBatch into padded tensors aligned for next-token logprobs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from miles_train.types import TrainBatch


@dataclass
class Collated:
    input_ids: torch.Tensor  # [B, T], right-padded
    attention_mask: torch.Tensor  # [B, T]
    targets: torch.Tensor  # [B, T-1]: the token each position predicts
    loss_mask: torch.Tensor  # [B, T-1]: 1 where the predicted token is a trained response token
    rollout_logprobs: torch.Tensor  # [B, T-1], 0 outside responses
    # [B, T, layers × top_k]: the experts the engine routed each position to, −1 where it gave none (a mixture of
    # experts whose engine returned its routing; else None)
    routed_experts: torch.Tensor | None = None


def collate(batch: TrainBatch, pad_token_id: int = 0) -> Collated:
    rows = len(batch)
    width = max(len(ids) for ids in batch.input_ids)
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    loss_mask = torch.zeros((rows, width - 1), dtype=torch.float32)
    rollout = torch.zeros((rows, width - 1), dtype=torch.float32)
    for i, ids in enumerate(batch.input_ids):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        start = batch.response_start[i]  # token `start` is predicted at position start-1
        stop = start - 1 + len(batch.loss_mask[i])
        loss_mask[i, start - 1 : stop] = torch.tensor(batch.loss_mask[i], dtype=torch.float32)
        rollout[i, start - 1 : stop] = torch.tensor(batch.rollout_logprobs[i], dtype=torch.float32)
    return Collated(input_ids, attention, input_ids[:, 1:], loss_mask, rollout, _routed(batch, width))


def _routed(batch: TrainBatch, width: int) -> torch.Tensor | None:
    """The rows' routed experts laid out by position, [B, width, layers × top_k], −1 where a row has none."""
    rows = batch.routed_experts
    given = [r for r in rows or [] if r is not None]
    if not given:
        return None
    out = torch.full((len(batch), width, given[0].shape[-1]), -1, dtype=torch.long)
    for i, routed in enumerate(rows or []):
        if routed is not None:
            out[i, : routed.shape[0]] = torch.as_tensor(routed, dtype=torch.long)[:width]
    return out


def response_layout(batch: TrainBatch, values: list[list[float]], fill: float = 0.0) -> torch.Tensor:
    """Per-response-token `values` (one list per row, one entry per response token) laid out like `collate`'s
    loss mask, [B, T-1]; `fill` elsewhere."""
    width = max(len(ids) for ids in batch.input_ids)
    out = torch.full((len(batch), width - 1), fill, dtype=torch.float32)
    for i, row in enumerate(values):
        start = batch.response_start[i]
        out[i, start - 1 : start - 1 + len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def token_logprobs(
    model: torch.nn.Module, collated: Collated, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each next token [B, T-1] under an HF causal LM (and the entropy, without grad)."""
    logits = model(input_ids=collated.input_ids, attention_mask=collated.attention_mask).logits
    return logprobs_from_logits(logits, collated, temperature, with_entropy)


def logprobs_from_logits(
    logits: torch.Tensor,
    collated: Collated,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """From [B, T, V] logits: the logprob of each next token [B, T-1] (and the policy entropy per
    position: without grad unless `entropy_grad`, for an entropy bonus)."""
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logprobs_all = torch.log_softmax(logits, dim=-1)
    logprobs = logprobs_all.gather(-1, collated.targets[..., None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with contextlib.nullcontext() if entropy_grad else torch.no_grad():
            entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)
    return logprobs, entropy


def unpad_response(values: torch.Tensor, batch: TrainBatch) -> list[list[float]]:
    out = []
    for i in range(len(batch)):
        start = batch.response_start[i] - 1
        out.append(values[i, start : start + len(batch.loss_mask[i])].tolist())
    return out
