"""GRPO pieces as pure tensor functions: advantages, the clipped ratio loss, k3 KL, aggregation."""

from __future__ import annotations

import torch

from miles_train.objectives import group_baseline_advantages


def group_advantages(
    rewards: list[float], group_index: list[int], normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """A_i = (r_i − mean of its group) [/ (std of its group + eps)], one value per sample (float32).

    The std is the unbiased sample std (as `torch.std`); a group of one sample, or one whose rewards are all equal,
    gets advantage exactly 0. The GRPO objective's estimator (`miles_train.objectives`), kept under its first name.
    """
    mode = "std" if normalize_std else "mean"
    return group_baseline_advantages(rewards, group_index, mode, eps).float()


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO-style loss −min(ρA, clip(ρ, 1−ε, 1+ε_high)A); returns (loss, ratio, clipped)."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, ratio, (clipped < unclipped)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π‖π_ref) per token: exp(Δ) − Δ − 1 with Δ = ref − π (≥ 0)."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def token_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None) -> torch.Tensor:
    """Sum over unmasked tokens divided by `num_tokens` (default: the number of unmasked tokens).

    Passing the token count of the whole global batch keeps the mean exact when the batch is
    split across ranks or minibatches.
    """
    denom = mask.sum() if num_tokens is None else num_tokens
    return (values * mask).sum() / max(float(denom), 1.0)


def truncated_is_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token min(π_old / π_rollout, cap) (no gradient) and where the cap bit.

    Corrects for the engine's policy differing from the trainer's old policy (stale weights in an
    asynchronous schedule, or numerical mismatch): the loss of each token is scaled by the weight.
    """
    ratio = torch.exp(old_logprobs.detach() - rollout_logprobs.detach())
    return ratio.clamp(max=cap), ratio > cap


def masked_is_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked importance sampling: weight 1 where π_old / π_rollout lies in [low, high], 0 outside (no gradient),
    and where tokens were dropped. Unlike TIS, a token whose ratio is far off does not train at all: its sample
    came from numerics (or weights) too different from the trainer's to be corrected by a bounded weight."""
    ratio = torch.exp(old_logprobs.detach() - rollout_logprobs.detach())
    dropped = (ratio < low) | (ratio > high)
    return (~dropped).to(ratio.dtype), dropped


def staleness_weights(staleness: list[int], mode: str, decay: float, max_staleness: int) -> torch.Tensor:
    """One weight per sample from its age in weight versions: `none` 1, `decay` decay**age, `drop` 0 past max."""
    age = torch.tensor(staleness, dtype=torch.float32)
    if mode == "none":
        return torch.ones_like(age)
    if mode == "decay":
        return torch.pow(torch.tensor(decay), age)
    if mode == "drop":
        return (age <= max_staleness).float()
    raise ValueError(f"unknown staleness mode {mode!r}")
