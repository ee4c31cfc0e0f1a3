"""RolloutBatch (rollout side) → TrainBatch (training side): the one place the two contracts meet."""

from __future__ import annotations

from miles_rollout.types import RolloutBatch, Sample, SampleStatus
from miles_train.types import TrainBatch


def to_train_batch(batch: RolloutBatch, staleness: list[int] | None = None) -> TrainBatch:
    """Token ids pass through untouched; aborted samples are left out (they have no reward). The trainer
    recomputes logprobs at the temperature the engine reported them at (`SamplingParams.logprob_temperature`).

    `staleness`, one per sample of `batch`, is the trainer version minus the oldest engine version the
    sample was generated under (asynchronous schedules); a sample that spans a push (any pause mode, or continued
    by partial rollouts) gives each token its own age (`token_staleness`).
    """
    if batch.sampling is None:
        raise ValueError("to_train_batch: the RolloutBatch does not say how it was sampled (batch.sampling is None)")
    keep = [i for i, s in enumerate(batch.samples) if s.status != SampleStatus.ABORTED and s.response_ids]
    samples = [batch.samples[i] for i in keep]
    ages = None if staleness is None else [staleness[i] for i in keep]
    return TrainBatch(
        staleness=ages,
        token_staleness=None if ages is None else token_staleness(samples, ages),
        input_ids=[s.prompt_ids + s.response_ids for s in samples],
        response_start=[len(s.prompt_ids) for s in samples],
        rollout_logprobs=[s.rollout_logprobs for s in samples],
        loss_mask=[s.loss_mask for s in samples],
        rewards=[s.reward for s in samples],
        group_index=[s.group_index for s in samples],
        temperature=batch.sampling.logprob_temperature,
        routed_experts=[s.routed_experts for s in samples]
        if any(s.routed_experts is not None for s in samples)
        else None,
        multimodal=[s.multimodal for s in samples] if any(s.multimodal for s in samples) else None,
    )


def token_staleness(samples: list[Sample], staleness: list[int]) -> list[list[int]] | None:
    """The age of every response token (partial rollouts): the sample's staleness less how much newer than the
    sample's oldest version the token's own version is. None when no token is newer than its sample's oldest."""
    newer = [[v - s.oldest_weight_version for v in s.token_versions] for s in samples]
    if not any(any(row) for row in newer):
        return None
    return [
        [age - d for d in row] if len(row) == len(s.response_ids) else [age] * len(s.response_ids)
        for s, age, row in zip(samples, staleness, newer, strict=True)
    ]


def rollout_metrics(batch: RolloutBatch) -> dict[str, float]:
    from miles_rollout.code_reward import code_metrics
    from miles_rollout.hubs.verifiers_env import verifiers_metrics
    from miles_rollout.judge import judge_metrics

    samples = batch.samples
    rewards = [s.reward for s in samples]
    mean = sum(rewards) / len(rewards)
    groups: dict[int, list[float]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s.reward)
    rollout_time = sum(t.end - t.start for t in batch.timings if t.stage == "rollout")
    return (
        batch.metrics
        | episode_metrics(batch)
        | code_metrics(batch.samples)
        | verifiers_metrics(batch.samples)
        | judge_metrics(batch.samples)
        | {
            "rollout/reward_mean": mean,
            "rollout/reward_std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5,
            "rollout/response_length": batch.num_response_tokens / len(samples),
            "rollout/truncated_frac": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
            "rollout/zero_std_group_frac": sum(len(set(g)) == 1 for g in groups.values()) / len(groups),
            "rollout/tokens_per_s": batch.num_response_tokens / max(rollout_time, 1e-9),
        }
    )


def episode_metrics(batch: RolloutBatch) -> dict[str, float]:
    """Of multi-turn episodes (`metadata["episode"]`): model turns per episode, the share of environment tokens
    in the responses, and the share of episodes ending for each reason (`rollout/end_<reason>`)."""
    episodes = [s.metadata["episode"] for s in batch.samples if isinstance(s.metadata.get("episode"), dict)]
    if not episodes:
        return {}
    tokens = sum(len(s.loss_mask) for s in batch.samples)
    env_tokens = sum(len(s.loss_mask) - sum(s.loss_mask) for s in batch.samples)
    out = {
        "rollout/num_turns": sum(e["num_turns"] for e in episodes) / len(episodes),
        "rollout/env_token_frac": env_tokens / max(tokens, 1),
    }
    reasons = [e["end_reason"] for e in episodes]
    for reason in sorted(set(reasons)):
        out[f"rollout/end_{reason}"] = reasons.count(reason) / len(reasons)
    return out


def staleness_metrics(staleness: list[int]) -> dict[str, float]:
    """Mean, max and a histogram (`async/staleness_eq_k`: share of samples k versions old)."""
    if not staleness:
        return {}
    out = {"async/staleness_mean": sum(staleness) / len(staleness), "async/staleness_max": float(max(staleness))}
    for k in sorted(set(staleness)):
        out[f"async/staleness_eq_{k}"] = staleness.count(k) / len(staleness)
    return out
