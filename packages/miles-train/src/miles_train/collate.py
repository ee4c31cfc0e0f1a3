"""Turn a TrainBatch into padded tensors aligned for next-token logprobs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from miles_sync.vision import batch_inputs
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
    # a batch with images: what the model's forward takes for them besides the ids (a vision-language model's
    # `pixel_values`, `image_grid_thw`, `mm_token_type_ids` [B, T]); empty for text
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)


def collate(batch: TrainBatch, pad_token_id: int = 0) -> Collated:
    width = max(len(ids) for ids in batch.input_ids)
    ids_rows, attention_rows, mask_rows, rollout_rows = [], [], [], []
    for i, ids in enumerate(batch.input_ids):  # padded Python rows, then one tensor per field
        ids_rows.append(list(ids) + [pad_token_id] * (width - len(ids)))
        attention_rows.append([1] * len(ids) + [0] * (width - len(ids)))
        before = batch.response_start[i] - 1  # token `start` is predicted at position start-1
        after = width - 1 - before - len(batch.loss_mask[i])
        mask_rows.append([0.0] * before + [float(m) for m in batch.loss_mask[i]] + [0.0] * after)
        rollout_rows.append([0.0] * before + [float(x) for x in batch.rollout_logprobs[i]] + [0.0] * after)
    input_ids = torch.tensor(ids_rows, dtype=torch.long)
    return Collated(
        input_ids,
        torch.tensor(attention_rows, dtype=torch.long),
        input_ids[:, 1:],
        torch.tensor(mask_rows, dtype=torch.float32),
        torch.tensor(rollout_rows, dtype=torch.float32),
        _routed(batch, width),
        batch_inputs(batch.multimodal or [], [0] * len(batch), width),
    )


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
    rows = []
    for i, row in enumerate(values):
        before = batch.response_start[i] - 1
        rows.append([fill] * before + [float(v) for v in row] + [fill] * (width - 1 - before - len(row)))
    return torch.tensor(rows, dtype=torch.float32).reshape(len(batch), width - 1)


def token_logprobs(
    model: torch.nn.Module, collated: Collated, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each next token [B, T-1] under an HF causal LM (and the entropy, without grad)."""
    logits = model(input_ids=collated.input_ids, attention_mask=collated.attention_mask, **collated.model_inputs).logits
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
