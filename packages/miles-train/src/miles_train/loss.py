"""The per-token loss of a policy update, as small terms that an objective combines.

A step's loss on one rank's rows of a minibatch is

    per_token = policy × correction weights + penalties

- the **policy term**: the objective's `policy_loss` (the clipped ratio loss by default), checked;
- **correction weights**, each a per-token factor on the policy term, no gradient: truncated importance sampling
  (`tis_cap`), masked importance sampling (`mis_band`), the staleness weight of off-policy tokens (`staleness`);
- **penalties**, added: the KL to the frozen reference (`kl_coef`, unless the objective puts it in the reward) and
  the entropy bonus (`entropy_coef`).

`LossTerms.standard` builds the terms the settings (`train.algorithm`) ask for; an objective may override
`Objective.loss_terms` to drop or add one. The value term of PPO's critic (`value_loss`) lives here too; the critic
applies it to its own model (critic.py). `aggregate` turns the per-token losses into one number whose sum over
ranks is the loss of the unsplit minibatch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_train.config import ALGORITHMS, AlgorithmConfig

Metrics = dict[str, torch.Tensor]  # per-token values [b, W]; the update sums them under the mask


class ObjectiveError(ValueError):
    """What an objective returned cannot be trained on; raised before the optimizer steps."""


# ---- pure functions ------------------------------------------------------------------------------------------
def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from samples of π, with Δ = log π_ref − log π (Schulman's k1, k2, k3):
    k1 = −Δ (unbiased, can be negative), k2 = Δ²/2, k3 = e^Δ − Δ − 1 (unbiased, ≥ 0)."""
    delta = ref_logprobs - logprobs
    if kind == "k1":
        return -delta
    if kind == "k2":
        return 0.5 * delta.square()
    if kind == "k3":
        return torch.exp(delta) - delta - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}")


def ppo_clip(
    ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float, dual_clip: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """−min(ρA, clip(ρ, 1−low, 1+high)A), and for A < 0 with dual clip c at most −cA (Ye et al. 2020); the loss and
    where the clip bit (either clip)."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - low, 1.0 + high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    bit = clipped < unclipped
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        bit = bit | dual
    return loss, bit


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[b] mean over each sequence's trained tokens of log π − log π_old (GSPO's length-normalised log ratio)."""
    return ((logprobs - old_logprobs) * mask).sum(1) / mask.sum(1).clamp(min=1.0)


def truncated_is_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token min(π_old / π_rollout, cap) (no gradient) and where the cap bit: corrects for the engine's policy
    differing from the trainer's old policy (stale weights, or numerical mismatch)."""
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
    """One weight per sample (or token) from its age in weight versions: `none` 1, `decay` decay**age, `drop` 0
    past `max_staleness`."""
    age = torch.tensor(staleness, dtype=torch.float32)
    if mode == "none":
        return torch.ones_like(age)
    if mode == "decay":
        return torch.pow(torch.tensor(decay), age)
    if mode == "drop":
        return (age <= max_staleness).float()
    raise ValueError(f"unknown staleness mode {mode!r}")


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The value term: per-token ½(V − R)², or with `clip` c ½·max((V − R)², (V_old + clip(V − V_old, −c, c) − R)²)
    (PPO's clipped value loss); and where the clipped term is the larger."""
    unclipped = (values - returns).square()
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(values, dtype=torch.bool)
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, num_tokens: float, num_sequences: float
) -> torch.Tensor:
    """One loss from per-token losses [b, W]. `num_tokens` / `num_sequences` count the whole minibatch on every rank
    (sequences with at least one trained token), so the sum of each rank's result is the loss of the unsplit batch.
    What lies off the mask never counts, a NaN there included."""
    masked = torch.where(mask.bool(), per_token, 0.0)
    if mode == "token_mean":
        return masked.sum() / max(num_tokens, 1.0)
    per_sequence = masked.sum(1)
    if mode == "seq_mean_token_mean":
        per_sequence = per_sequence / mask.sum(1).clamp(min=1.0)
    elif mode != "seq_mean_token_sum":
        raise ValueError(f"unknown aggregation {mode!r}")
    return per_sequence.sum() / max(num_sequences, 1.0)


def denominators(loss_masks: list[list[int]]) -> tuple[float, float]:
    """(trained tokens, sequences with at least one trained token) of a minibatch's rows."""
    counts = [sum(m) for m in loss_masks]
    return float(sum(counts)), float(sum(1 for n in counts if n > 0))


# ---- the terms -----------------------------------------------------------------------------------------------
@dataclass
class LossInputs:
    """What an objective computes the per-token policy loss from: this rank's rows of one minibatch."""

    logprobs: torch.Tensor  # [b, W] under the current policy, with gradient
    old_logprobs: torch.Tensor  # [b, W] of the behaviour policy (the ratio's denominator), no gradient
    advantages: torch.Tensor  # [b, W] per token (a per-sample estimate broadcast over its tokens)
    mask: torch.Tensor  # [b, W] float
    clip_low: float  # train.algorithm.clip_eps
    clip_high: float  # train.algorithm.clip_eps_high, else clip_eps
    dual_clip: float | None = None


@dataclass
class TermInputs:
    """Everything a term may read, for this rank's rows of one minibatch ([b, W] each)."""

    policy: LossInputs
    rollout_logprobs: torch.Tensor  # the engine's, no gradient
    entropy: torch.Tensor  # the policy's per-token entropy (with a gradient where a bonus needs one)
    token_weights: torch.Tensor  # the staleness weight of each token (1 where staleness is none)
    ref_logprobs: torch.Tensor | None = None  # the frozen reference's, when a KL term asks for them


Term = Callable[[TermInputs], tuple[torch.Tensor, Metrics]]  # per-token loss (or weight) and its metrics


@dataclass
class PolicyTerm:
    """The objective's `policy_loss`, checked (shape, a gradient, and with `check_values` finite values); reports
    the clip fraction. Errors name the objective as train.algorithm.name does (`name`)."""

    objective: Any  # miles_train.objectives.Objective
    name: str
    check_values: bool

    def __call__(self, x: TermInputs) -> tuple[torch.Tensor, Metrics]:
        name = self.name
        try:
            result = self.objective.policy_loss(x.policy)
        except Exception as exc:  # a user objective's error on one rank's rows: every rank must stop
            raise ObjectiveError(f"objective {name}: policy_loss raised {type(exc).__name__}: {exc}") from exc
        loss = check_loss(name, result, x.policy.logprobs, x.policy.mask, self.check_values)
        return loss, {"clipfrac": result[1].float()}


@dataclass
class TruncatedIS:
    """Weight each token's policy loss by min(π_old / π_rollout, cap)."""

    cap: float

    def __call__(self, x: TermInputs) -> tuple[torch.Tensor, Metrics]:
        weights, truncated = truncated_is_weights(x.policy.old_logprobs, x.rollout_logprobs, self.cap)
        return weights, {"tis": weights, "tis_clipfrac": truncated.float()}


@dataclass
class MaskedIS:
    """Drop the policy loss of the tokens whose π_old / π_rollout lies outside [low, high]."""

    low: float
    high: float

    def __call__(self, x: TermInputs) -> tuple[torch.Tensor, Metrics]:
        keep, dropped = masked_is_weights(x.policy.old_logprobs, x.rollout_logprobs, self.low, self.high)
        return keep, {"mis_dropfrac": dropped.float()}


def staleness_term(x: TermInputs) -> tuple[torch.Tensor, Metrics]:
    """Weight each token's policy loss by its staleness weight (`TermInputs.token_weights`)."""
    return x.token_weights, {}


@dataclass
class KLPenalty:
    """coef × the KL estimate to the frozen reference, added to the loss (`in_loss`), or only reported when the
    objective puts the KL in the reward."""

    coef: float
    estimator: str
    in_loss: bool

    def __call__(self, x: TermInputs) -> tuple[torch.Tensor, Metrics]:
        if x.ref_logprobs is None:
            raise ValueError("the KL term needs the reference's logprobs (the trainer holds no reference model)")
        kl = kl_estimate(x.policy.logprobs, x.ref_logprobs, self.estimator)
        return (self.coef * kl if self.in_loss else torch.zeros_like(kl)), {"kl": kl}


@dataclass
class EntropyBonus:
    """−coef × the policy's per-token entropy."""

    coef: float

    def __call__(self, x: TermInputs) -> tuple[torch.Tensor, Metrics]:
        return -self.coef * x.entropy, {}


@dataclass
class LossTerms:
    """The policy term, the correction weights applied to it in order, and the penalties added after."""

    policy: Term
    weights: list[Term] = field(default_factory=list)
    penalties: list[Term] = field(default_factory=list)

    @classmethod
    def standard(cls, objective: Any, settings: AlgorithmConfig, *, kl_in_loss: bool, reference: bool) -> LossTerms:
        """The terms `settings` asks for: TIS, MIS and staleness weights, the KL (when a reference is held and
        kl_coef > 0; in the loss unless `kl_in_loss` is false) and the entropy bonus."""
        weights: list[Term] = []
        if settings.tis_cap is not None:
            weights.append(TruncatedIS(settings.tis_cap))
        if settings.mis_band is not None:
            weights.append(MaskedIS(*settings.mis_band))
        weights.append(staleness_term)
        penalties: list[Term] = []
        if reference and settings.kl_coef > 0:
            penalties.append(KLPenalty(settings.kl_coef, settings.kl_estimator, kl_in_loss))
        if settings.entropy_coef > 0:
            penalties.append(EntropyBonus(settings.entropy_coef))
        check = settings.name not in ALGORITHMS  # a user objective's values are checked every step
        return cls(PolicyTerm(objective, settings.name, check), weights, penalties)

    @property
    def needs_reference(self) -> bool:
        """Whether a term reads the reference's logprobs."""
        return any(isinstance(term, KLPenalty) for term in self.penalties)

    def combine(self, x: TermInputs) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        """(per-token loss, the weighted policy term, every term's metrics)."""
        policy, metrics = self.policy(x)
        for weight in self.weights:
            factor, more = weight(x)
            policy = policy * factor
            metrics.update(more)
        per_token = policy
        for penalty in self.penalties:
            value, more = penalty(x)
            per_token = per_token + value
            metrics.update(more)
        return per_token, policy, metrics


def check_loss(name: str, value: Any, logprobs: torch.Tensor, mask: torch.Tensor, values: bool) -> torch.Tensor:
    """The per-token loss of `policy_loss`, or ObjectiveError: shape, a gradient, and (`values`) finite values."""
    if not (isinstance(value, tuple) and len(value) == 2):
        raise ObjectiveError(f"objective {name}: policy_loss must return (per-token loss, clipped), got {value!r:.80}")
    loss, clipped = value
    if not isinstance(loss, torch.Tensor) or loss.shape != logprobs.shape:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ObjectiveError(f"objective {name}: policy loss has shape {shape}; expected {tuple(logprobs.shape)}")
    if not isinstance(clipped, torch.Tensor) or clipped.shape != logprobs.shape:
        shape = tuple(clipped.shape) if isinstance(clipped, torch.Tensor) else type(clipped).__name__
        raise ObjectiveError(f"objective {name}: clipped has shape {shape}; expected {tuple(logprobs.shape)}")
    if not loss.requires_grad:
        raise ObjectiveError(
            f"objective {name}: the policy loss {tuple(loss.shape)} has no gradient (computed without the "
            "logprobs, or under torch.no_grad)"
        )
    if values:
        bad = ~torch.isfinite(loss.detach()) & mask.bool()
        if bad.any():
            row, col = (int(i) for i in torch.nonzero(bad)[0])
            raise ObjectiveError(
                f"objective {name}: policy loss {tuple(loss.shape)} is {float(loss[row, col].detach())} at row {row} "
                f"token {col}"
            )
    return loss
