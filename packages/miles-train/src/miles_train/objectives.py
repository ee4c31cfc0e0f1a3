"""Objectives: advantage estimation and the policy term of the loss, one plug-in per algorithm.

`train.algorithm.name` picks a built-in or a user class named by a dotted path; every trainer backend runs it in
the same update (`backends/update.py`). The objective combines its policy term with the loss terms every algorithm
shares (miles_train/loss.py: truncated or masked importance sampling, staleness weights, the KL to the reference in
the loss, the entropy bonus); the KL goes into the reward instead where the algorithm or `kl_in_reward` says so, and
the per-token losses are aggregated over the global minibatch.

The contract of an objective (subclass `Objective`; built-ins are subclasses too):
- `advantages(inputs: AdvantageInputs) -> Tensor`: for the whole batch (every rank sees every group), either one
  value per sample, shape [B], or one per token, shape [B, W] aligned with `inputs.mask`.
- `policy_loss(inputs: LossInputs) -> (loss, clipped)`: per-token losses [b, W] with a gradient to
  `inputs.logprobs`, and where the clip bit (bool [b, W], for the clip fraction).
- `loss_terms(settings, kl_in_loss, reference) -> LossTerms` (optional): the terms the loss combines; by default
  the policy term, then the corrections and penalties `train.algorithm` asks for (`LossTerms.standard`).
- class attributes `name`, `aggregation` (its default) and `kl_in_reward` (its default); `needs_logprobs` when the
  advantages read the old policy's and the frozen model's logprobs; `needs_values` when they read a learned critic
  (`inputs.values`): then `value_targets(inputs) -> Tensor` [B, W] gives what the critic regresses to, and the
  trainer holds, trains, saves and resumes a value model (`train.critic`, miles_train/critic.py).
The update checks what a user objective returns (shape, finite values under the mask, a gradient) and fails
naming the objective and the offending tensor before any optimizer step.

Formulas, with ρ = π/π_old per token, A the advantage and groups of G samples of one prompt:
- grpo (Shao et al. 2024): A = (r − mean_g r) / (std_g r + ε), the unbiased std; clipped ρ; token mean.
- dr_grpo (Liu et al. 2025, "Understanding R1-Zero-like training"): A = r − mean_g r; sequence-sum aggregation.
- gspo (Zheng et al. 2025): s = exp(mean over the response of log ρ), clipped at the sequence level,
  loss −min(sA, clip(s)A) per sequence, averaged over sequences.
- rloo (Ahmadian et al. 2024): A = r − mean of the group's other rewards = G/(G−1) (r − mean_g r).
- reinforce_pp (Hu 2025, REINFORCE++): token reward −β·KL_t with the sequence's reward added at its last token,
  return G_t = Σ_{s≥t} reward_s, A = (G_t − mean) / (std + ε) over every token of the global batch.
  reinforce_pp_baseline subtracts each group's mean reward before the returns.
- ppo (Schulman et al. 2017; GAE: Schulman et al. 2016; the RLHF form of Ouyang et al. 2022): token rewards as in
  reinforce_pp (−β·KL_t, the reward at the last token), a learned value V_t per token, δ_t = r_t + γV_{t+1} − V_t,
  A_t = Σ_l (γλ)^l δ_{t+l} over the sequence's trained tokens (V = 0 after the last), whitened over the batch; the
  critic regresses to the returns A_t + V_t with a clipped squared error.
- distill (on-policy distillation): A_t = log π_teacher(y_t) − log π_old(y_t), per token.
- sft: −log π of every response token (supervised fine-tuning; `kind: sft` makes the labels the responses).
Groups of one sample, and groups (or batches, for reinforce_pp) whose values all agree, get advantages of exactly 0.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from miles_train.config import ALGORITHMS, AlgorithmConfig
from miles_train.loss import LossInputs, LossTerms, ObjectiveError, ppo_clip, sequence_log_ratio

__all__ = [  # LossInputs and ObjectiveError belong to an objective's contract; they live in miles_train.loss
    "BUILTINS",
    "AdvantageInputs",
    "LossInputs",
    "Objective",
    "ObjectiveError",
    "build_objective",
    "check_advantages",
    "gae",
    "group_baseline_advantages",
    "returns_to_go",
    "token_rewards",
    "whiten",
]

EPS = 1e-6


# ---- pure functions ------------------------------------------------------------------------------------------
def _groups(group_index: list[int]) -> list[list[int]]:
    members: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(group_index):
        members[g].append(i)
    return list(members.values())


def group_baseline_advantages(
    rewards: torch.Tensor | list[float], group_index: list[int], mode: str, eps: float = EPS
) -> torch.Tensor:
    """Per-sample advantages from the group's rewards, in float64: `std` (r − mean)/(std + eps), `mean` r − mean,
    `leave_one_out` r − mean of the others. A group of one, or one whose rewards are all equal, gives exactly 0
    (rounding in the mean of 0.7 × 8 would otherwise leave a spurious ±1e-8, which `std` would magnify)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    out = torch.zeros_like(r)
    for rows in _groups(group_index):
        idx = torch.tensor(rows)
        values = r[idx]
        if len(rows) < 2 or bool((values == values[0]).all()):
            continue
        centred = values - values.mean()
        if mode == "std":
            out[idx] = centred / (values.std() + eps)
        elif mode == "mean":
            out[idx] = centred
        elif mode == "leave_one_out":
            out[idx] = centred * len(rows) / (len(rows) - 1)
        else:
            raise ValueError(f"unknown group baseline {mode!r}")
    return out


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor, kl_penalty: torch.Tensor | None = None) -> torch.Tensor:
    """[B, W] per-token rewards: −kl_penalty on every trained token, plus the sequence's reward at its last one."""
    out = torch.zeros(mask.shape, dtype=torch.float64)
    if kl_penalty is not None:
        out -= kl_penalty.double() * mask
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask.bool(), positions, -1).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] += rewards.double()[rows]
    return out


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """G_t = Σ_{s ≥ t} reward_s over the trained tokens (γ = 1), 0 elsewhere."""
    masked = rewards * mask
    return masked.flip(1).cumsum(1).flip(1) * mask


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's trained tokens, [B, W] each: (advantages, returns).

    The steps of a row are its masked tokens in order (a tool turn's tokens between two of them are part of the
    transition, not steps); after the last one the value is 0. δ_t = r_t + γ·V_next − V_t, A_t = δ_t + γλ·A_next,
    returns = A + V. Computed in float64, right to left, one column at a time over all rows; 0 off the mask."""
    rewards, values, on = rewards.double(), values.double(), mask.bool()
    advantages = torch.zeros_like(values)
    running = torch.zeros(values.shape[0], dtype=torch.float64)
    next_value = torch.zeros_like(running)
    for t in range(values.shape[1] - 1, -1, -1):
        here = on[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(here, delta + gamma * lam * running, running)
        next_value = torch.where(here, values[:, t], next_value)
        advantages[:, t] = torch.where(here, running, 0.0)
    return advantages, (advantages + values) * on


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """(v − mean) / (std + eps) over the masked entries (unbiased std), 0 elsewhere; exactly 0 when they all agree."""
    chosen = values[mask.bool()]
    if chosen.numel() < 2 or bool((chosen == chosen[0]).all()):
        return torch.zeros_like(values)
    return (values - chosen.mean()) / (chosen.std() + eps) * mask


# ---- the contract --------------------------------------------------------------------------------------------
@dataclass
class AdvantageInputs:
    """What an objective estimates advantages from: the whole batch, identical on every rank."""

    rewards: torch.Tensor  # [B] float64, as scored
    group_index: list[int]  # [B]: samples of one prompt share a value
    mask: torch.Tensor  # [B, W] float: 1 on trained response tokens (W: the batch's padded width − 1)
    kl_penalty: torch.Tensor | None  # [B, W] kl_coef × KL estimate of each token under the old policy, when in reward
    normalize_std: bool = True  # train.algorithm.normalize_std (grpo's)
    # for an objective with `needs_logprobs`: [B, W] the behaviour policy's and the frozen model's (the reference,
    # or distill's teacher) log-probability of each sampled token, no gradient
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    # for an objective with `needs_values`: [B, W] the critic's value of each trained token's state (before the token
    # is generated), no gradient, and GAE's discount and λ (train.critic)
    values: torch.Tensor | None = None
    gamma: float = 1.0
    lam: float = 0.95

    def sequence_rewards(self) -> torch.Tensor:
        """Rewards less each sequence's summed KL penalty (when the KL is in the reward)."""
        if self.kl_penalty is None:
            return self.rewards
        return self.rewards - (self.kl_penalty.double() * self.mask).sum(1)


class Objective:
    """Base of every objective: the token-level clipped ratio loss, group advantages normalised by the std."""

    name: ClassVar[str] = "objective"
    aggregation: ClassVar[str] = "token_mean"
    kl_in_reward: ClassVar[bool] = False
    needs_logprobs: ClassVar[bool] = False  # AdvantageInputs carries the whole batch's old and frozen-model logprobs
    needs_values: ClassVar[bool] = False  # the trainer holds a critic; AdvantageInputs carries its values

    def advantages(self, inputs: AdvantageInputs) -> torch.Tensor:
        raise NotImplementedError

    def value_targets(self, inputs: AdvantageInputs) -> torch.Tensor:
        """[B, W] what the critic regresses to (an objective with `needs_values`)."""
        raise NotImplementedError(f"objective {self.name} needs values but defines no value_targets")

    def policy_loss(self, inputs: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token losses [b, W] with a gradient to `inputs.logprobs`, and where the clip bit: the clipped ratio."""
        ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
        return ppo_clip(ratio, inputs.advantages, inputs.clip_low, inputs.clip_high, inputs.dual_clip)

    def loss_terms(self, settings: AlgorithmConfig, *, kl_in_loss: bool, reference: bool) -> LossTerms:
        """The terms this objective's loss combines: `policy_loss`, then what `settings` asks for (an override may
        drop or add a term: see miles_train.loss)."""
        return LossTerms.standard(self, settings, kl_in_loss=kl_in_loss, reference=reference)


class GRPO(Objective):
    name = "grpo"

    def advantages(self, inputs: AdvantageInputs) -> torch.Tensor:
        mode = "std" if inputs.normalize_std else "mean"
        return group_baseline_advantages(inputs.sequence_rewards(), inputs.group_index, mode)


class DrGRPO(Objective):
    name = "dr_grpo"
    aggregation = "seq_mean_token_sum"

    def advantages(self, inputs: AdvantageInputs) -> torch.Tensor:
        return group_baseline_advantages(inputs.sequence_rewards(), inputs.group_index, "mean")


class RLOO(Objective):
    name = "rloo"

    def advantages(self, inputs: AdvantageInputs) -> torch.Tensor:
        return group_baseline_advantages(inputs.sequence_rewards(), inputs.group_index, "leave_one_out")


class GSPO(GRPO):
    """Group-normalised advantages (as grpo), the importance ratio and its clipping per sequence: every token of a
    sequence carries the sequence's loss, and seq_mean_token_mean makes it one term per sequence."""

    name = "gspo"
    aggregation = "seq_mean_token_mean"

    def policy_loss(self, inputs: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
        ratio = torch.exp(sequence_log_ratio(inputs.logprobs, inputs.old_logprobs, inputs.mask))
        # a sequence's advantage is the same on each of its tokens: take it from the first trained one
        first = torch.argmax(inputs.mask, dim=1, keepdim=True)
        adv = inputs.advantages.gather(1, first).squeeze(1)
        loss, bit = ppo_clip(ratio, adv, inputs.clip_low, inputs.clip_high, inputs.dual_clip)
        return loss[:, None].expand_as(inputs.logprobs), bit[:, None].expand_as(inputs.logprobs)


class ReinforcePP(Objective):
    name = "reinforce_pp"
    kl_in_reward = True
    group_baseline = False

    def advantages(self, inputs: AdvantageInputs) -> torch.Tensor:
        rewards = inputs.rewards.double()
        if self.group_baseline:
            rewards = group_baseline_advantages(rewards, inputs.group_index, "mean")
        returns = returns_to_go(token_rewards(rewards, inputs.mask, inputs.kl_penalty), inputs.mask)
        return whiten(returns, inputs.mask)


class ReinforcePPBaseline(ReinforcePP):
    name = "reinforce_pp_baseline"
    group_baseline = True


class PPO(Objective):
    """PPO with a learned critic: GAE over token rewards (the KL in the reward by default, as in RLHF), advantages
    whitened over the global batch, the token-level clipped ratio loss; the critic's targets are the returns."""

    name = "ppo"
    kl_in_reward = True
    needs_values = True

    def _gae(self, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
        if inputs.values is None:
            raise ValueError("ppo: the critic's values are missing (the trainer holds no value model)")
        rewards = token_rewards(inputs.rewards, inputs.mask, inputs.kl_penalty)
        return gae(rewards, inputs.values, inputs.mask, inputs.gamma, inputs.lam)

    def advantages(self, inputs: AdvantageInputs) -> torch.Tensor:
        return whiten(self._gae(inputs)[0], inputs.mask)

    def value_targets(self, inputs: AdvantageInputs) -> torch.Tensor:
        return self._gae(inputs)[1]


class Distill(Objective):
    """On-policy distillation (Agarwal et al. 2024, GKD; Lu & Thinking Machines 2025): the student samples, the
    teacher (train.teacher) scores every sampled token, and each token's advantage is log π_teacher − log π_student
    under the behaviour policy: minus the per-token reverse KL, so the policy-gradient step lowers KL(π‖π_teacher)
    token by token (no discount over later tokens). The clipped ratio loss keeps the update near π_old."""

    name = "distill"
    needs_logprobs = True

    def advantages(self, inputs: AdvantageInputs) -> torch.Tensor:
        if inputs.ref_logprobs is None or inputs.old_logprobs is None:
            raise ValueError("distill: the teacher's logprobs are missing (train.teacher is not loaded)")
        return (inputs.ref_logprobs.double() - inputs.old_logprobs.double()) * inputs.mask


class SFT(Objective):
    """Supervised fine-tuning (`kind: sft`): the negative log-likelihood of the response tokens; no advantage."""

    name = "sft"

    def advantages(self, inputs: AdvantageInputs) -> torch.Tensor:
        return torch.zeros(len(inputs.rewards), dtype=torch.float64)

    def policy_loss(self, inputs: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return -inputs.logprobs, torch.zeros_like(inputs.logprobs, dtype=torch.bool)


BUILTINS: dict[str, type[Objective]] = {
    cls.name: cls for cls in (GRPO, DrGRPO, GSPO, RLOO, ReinforcePP, ReinforcePPBaseline, PPO, Distill, SFT)
}
assert set(BUILTINS) == set(ALGORITHMS), "config.ALGORITHMS lists the built-ins"


def build_objective(config: AlgorithmConfig) -> Objective:
    """The objective `config.name` names, constructed with `config.options`; ValueError naming what is wrong (the
    field within train.algorithm)."""
    if config.name in BUILTINS:
        return BUILTINS[config.name]()
    from miles_sync.dotted_paths import resolve_dotted

    target: Any = resolve_dotted(config.name)
    if not (isinstance(target, type) and issubclass(target, Objective)):
        raise ValueError(
            f"name: {config.name!r} is not a subclass of miles_train.objectives.Objective (got {target!r})"
        )
    try:
        objective = target(**config.options)
    except TypeError as exc:
        raise ValueError(f"options: {config.name} does not take {config.options}: {exc}") from None
    from miles_train.config import Aggregation

    allowed = Aggregation.__args__  # type: ignore[attr-defined]
    if objective.aggregation not in allowed:
        raise ValueError(
            f"objective {config.name}: aggregation {objective.aggregation!r} is not one of {', '.join(allowed)}"
        )
    return objective


def check_advantages(
    name: str, value: Any, batch_size: int, width: int, mask: torch.Tensor, what: str = "advantage"
) -> torch.Tensor:
    """The advantages (or another per-token estimate, named by `what`) as [B, W] float32 (a per-sample estimate broadcast),
    or ObjectiveError naming the problem."""
    if not isinstance(value, torch.Tensor):
        raise ObjectiveError(f"objective {name}: {what}s must be a tensor, got {type(value).__name__}")
    if tuple(value.shape) == (batch_size,):
        value = value[:, None].expand(batch_size, width)
    elif tuple(value.shape) != (batch_size, width):
        raise ObjectiveError(
            f"objective {name}: {what}s have shape {tuple(value.shape)}; expected ({batch_size},) per sample or "
            f"({batch_size}, {width}) per token"
        )
    bad = ~torch.isfinite(value) & mask.bool()
    if bad.any():
        row, col = (int(i) for i in torch.nonzero(bad)[0])
        raise ObjectiveError(f"objective {name}: {what} of sample {row} token {col} is {float(value[row, col])}")
    return torch.where(mask.bool(), value, 0.0).float()  # what lies off the mask (padding, a tool turn) never counts
