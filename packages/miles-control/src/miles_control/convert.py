"""RolloutBatch (rollout side) → TrainBatch (training side): the one place the two contracts meet."""

from __future__ import annotations

from miles_rollout.types import RolloutBatch, SampleStatus
from miles_train.types import TrainBatch


def to_train_batch(batch: RolloutBatch, temperature: float) -> TrainBatch:
    """Token ids pass through untouched; aborted samples are left out (they have no reward)."""
    samples = [s for s in batch.samples if s.status != SampleStatus.ABORTED and s.response_ids]
    return TrainBatch(
        input_ids=[s.prompt_ids + s.response_ids for s in samples],
        response_start=[len(s.prompt_ids) for s in samples],
        rollout_logprobs=[s.rollout_logprobs for s in samples],
        loss_mask=[s.loss_mask for s in samples],
        rewards=[s.reward for s in samples],
        group_index=[s.group_index for s in samples],
        temperature=temperature if temperature > 0 else 1.0,
    )


def rollout_metrics(batch: RolloutBatch) -> dict[str, float]:
    samples = batch.samples
    rewards = [s.reward for s in samples]
    mean = sum(rewards) / len(rewards)
    groups: dict[int, list[float]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s.reward)
    rollout_time = sum(t.end - t.start for t in batch.timings if t.stage == "rollout")
    return {
        "rollout/reward_mean": mean,
        "rollout/reward_std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5,
        "rollout/response_length": batch.num_response_tokens / len(samples),
        "rollout/truncated_frac": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
        "rollout/zero_std_group_frac": sum(len(set(g)) == 1 for g in groups.values()) / len(groups),
        "rollout/tokens_per_s": batch.num_response_tokens / max(rollout_time, 1e-9),
    }
