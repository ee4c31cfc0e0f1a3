"""What a trainer is given each step. Plain lists, so it crosses process boundaries cheaply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TrainBatch:
    """Sequences exactly as the engine produced them (prompt ids + response ids), never re-tokenized.

    `response_start[i]` is the index of the first response token in `input_ids[i]`;
    `rollout_logprobs[i]` and `loss_mask[i]` have one entry per response token.
    """

    input_ids: list[list[int]]
    response_start: list[int]
    rollout_logprobs: list[list[float]]
    loss_mask: list[list[int]]
    rewards: list[float]
    group_index: list[int]
    temperature: float = 1.0
    staleness: list[int] | None = None  # per row: trainer version − oldest engine version it was generated under
    # per response token: trainer version − the engine version that token was generated under (partial rollouts);
    # None when every token of a row is as old as the row (`staleness` then says it)
    token_staleness: list[list[int]] | None = None
    # per row: the experts the engine routed each position to, an int tensor [positions, layers × top_k] over the
    # prompt and response less the last token (a mixture of experts: SGLang's `return_routed_experts`), or None for a
    # row the engine gave none for (train.routing_replay then lets the trainer's router choose)
    routed_experts: list[Any] | None = None
    # per row: a prompt with images, what the engine was given for them (the processor's tensors and
    # `mm_token_type_ids`, one per prompt id), or None for a text row; None when no row has images
    multimodal: list[dict[str, Any] | None] | None = None

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if self.multimodal is not None and len(self.multimodal) != n:
            raise ValueError(f"TrainBatch.multimodal has {len(self.multimodal)} rows, input_ids has {n}")
        if self.staleness is not None and len(self.staleness) != n:
            raise ValueError(f"TrainBatch.staleness has {len(self.staleness)} rows, input_ids has {n}")
        for field_name in ("response_start", "rollout_logprobs", "loss_mask", "rewards", "group_index"):
            if len(getattr(self, field_name)) != n:
                raise ValueError(
                    f"TrainBatch.{field_name} has {len(getattr(self, field_name))} rows, input_ids has {n}"
                )
        for i in range(n):
            num_response = len(self.input_ids[i]) - self.response_start[i]
            if len(self.rollout_logprobs[i]) != num_response or len(self.loss_mask[i]) != num_response:
                raise ValueError(
                    f"TrainBatch row {i}: {num_response} response tokens but "
                    f"{len(self.rollout_logprobs[i])} logprobs and {len(self.loss_mask[i])} mask entries"
                )
        if self.token_staleness is not None:
            if len(self.token_staleness) != n:
                raise ValueError(f"TrainBatch.token_staleness has {len(self.token_staleness)} rows, input_ids has {n}")
            for i, row in enumerate(self.token_staleness):
                if len(row) != len(self.input_ids[i]) - self.response_start[i]:
                    raise ValueError(
                        f"TrainBatch row {i}: {len(row)} token_staleness entries for "
                        f"{len(self.input_ids[i]) - self.response_start[i]} response tokens"
                    )

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_response_tokens(self) -> int:
        return sum(sum(m) for m in self.loss_mask)

    def select(self, rows: list[int]) -> TrainBatch:
        return TrainBatch(
            input_ids=[self.input_ids[i] for i in rows],
            response_start=[self.response_start[i] for i in rows],
            rollout_logprobs=[self.rollout_logprobs[i] for i in rows],
            loss_mask=[self.loss_mask[i] for i in rows],
            rewards=[self.rewards[i] for i in rows],
            group_index=[self.group_index[i] for i in rows],
            temperature=self.temperature,
            staleness=None if self.staleness is None else [self.staleness[i] for i in rows],
            token_staleness=None if self.token_staleness is None else [self.token_staleness[i] for i in rows],
            routed_experts=None if self.routed_experts is None else [self.routed_experts[i] for i in rows],
            multimodal=None if self.multimodal is None else [self.multimodal[i] for i in rows],
        )
