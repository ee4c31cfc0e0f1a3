"""The update every trainer runs, written once so the backends cannot drift apart: `train_step(trainer, batch)`,
which `Trainer.train_step` calls.

The framework supplies only what `miles_train.protocol.Backend` lists: the policy's logits, backward + optimizer
step (returning the gradient norm), and how its gradient reduction scales the loss. Everything numerical about the update is here and in the objective's loss terms (miles_train/loss.py): the
objective's advantages over the whole batch, per minibatch the policy term with its correction weights (TIS, MIS,
staleness) and penalties (KL, entropy), the aggregation over the global minibatch, PPO's critic step, and the metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from miles_train.backends.rows import agreed, all_reduce, quantile
from miles_train.backends.weights_as import update_kept
from miles_train.collate import Collated, collate, response_layout
from miles_train.loss import (
    LossInputs,
    LossTerms,
    TermInputs,
    aggregate,
    denominators,
    kl_estimate,
    staleness_weights,
)
from miles_train.objectives import AdvantageInputs, check_advantages
from miles_train.types import TrainBatch

if TYPE_CHECKING:
    from miles_train.backends.trainer import Trainer

METRIC_SUMS = (
    "loss",
    "pg_loss",
    "kl",
    "entropy",
    "clipfrac",
    "ratio",
    "logprob_diff",
    "tis",
    "tis_clipfrac",
    "mis_dropfrac",
    "mismatch_k3",
)  # summed over trained tokens and divided by their number; train/objective is the aggregated loss itself
CRITIC_SUMS = ("value_loss", "value_clipfrac", "value_pred")  # the same, for PPO's critic


def _reduce(trainer: Trainer, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    """`values` summed (or `op`) over the trainer's data-parallel group."""
    return all_reduce(values, trainer.device, trainer.backend.dp_group(), op)


def _advantages(
    trainer: Trainer,
    batch: TrainBatch,
    whole: Collated,
    old_logprobs: torch.Tensor | None,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, float | None]:
    """[B, W] advantages of the whole batch from the objective (checked), W the batch's padded width − 1; for an
    objective with a critic (`values`: the critic's, [B, W]), the critic's targets; and for one that reads a frozen
    model (distill), the mean KL to it."""
    algorithm = trainer.config.algorithm
    kl_coef = algorithm.kl_coef
    mask = whole.loss_mask
    penalty = old = ref = None
    wanted = trainer.objective.needs_logprobs
    if wanted or trainer.kl_in_reward:  # under the behaviour policy
        old = old_logprobs if old_logprobs is not None else whole.rollout_logprobs
    if (trainer.kl_in_reward or wanted) and trainer.reference is not None:
        ref = trainer._padded_logprobs(batch, model=trainer.reference)
        if trainer.kl_in_reward and kl_coef > 0:
            penalty = kl_coef * kl_estimate(old, ref, algorithm.kl_estimator) * mask
    inputs = AdvantageInputs(
        rewards=torch.tensor(batch.rewards, dtype=torch.float64),
        group_index=list(batch.group_index),
        mask=mask,
        kl_penalty=penalty,
        normalize_std=algorithm.normalize_std,
        old_logprobs=old if wanted else None,
        ref_logprobs=ref if wanted else None,
        values=None if values is None else values.double() * mask,
        gamma=trainer.config.critic_config.gamma,
        lam=trainer.config.critic_config.lam,
    )
    frozen_kl = None
    if wanted and old is not None and ref is not None:  # distill: k1 estimate of KL(student ‖ teacher) per token
        frozen_kl = float(((old - ref) * mask).sum() / mask.sum().clamp(min=1))
    value = trainer.objective.advantages(inputs)  # the whole batch on every rank: every rank agrees on the check
    advantages = check_advantages(algorithm.name, value, len(batch), mask.shape[1], mask)
    if values is None:
        return advantages, None, frozen_kl
    targets = trainer.objective.value_targets(inputs)
    checked = check_advantages(algorithm.name, targets, len(batch), mask.shape[1], mask, "value target")
    return advantages, checked, frozen_kl


def _token_weights(trainer: Trainer, batch: TrainBatch, sample_weights: torch.Tensor) -> torch.Tensor:
    """The staleness weight of every token, laid out like the batch's loss mask: its sample's weight, or, for
    a sample continued across a weight push (`token_staleness`), the weight of the token's own age."""
    settings = trainer.config.algorithm
    if batch.token_staleness is None:
        rows = [[float(w)] * len(m) for w, m in zip(sample_weights.tolist(), batch.loss_mask, strict=True)]
    else:
        rows = [
            staleness_weights(ages, settings.staleness, settings.staleness_decay, settings.drop_older_than).tolist()
            if ages else []
            for ages in batch.token_staleness
        ]  # fmt: skip
    return response_layout(batch, rows)


def train_step(trainer: Trainer, batch: TrainBatch) -> dict[str, float]:
    """One update on `batch` by `trainer`: advantages of the whole batch, then per minibatch this rank's
    rows' loss terms, backward and an optimizer step (and the critic's); the metrics of every rank, reduced."""
    settings = trainer.config.algorithm
    if len(batch) < settings.num_minibatches * trainer.backend.dp_size:
        raise ValueError(
            f"{trainer.name}: a batch of {len(batch)} samples cannot give each of {trainer.backend.dp_size} data-parallel "
            f"ranks a row in each of {settings.num_minibatches} minibatches"
        )
    minibatches = [list(range(len(batch)))[m :: settings.num_minibatches] for m in range(settings.num_minibatches)]
    sums = dict.fromkeys(METRIC_SUMS, 0.0)  # every key takes part in the reduction, in one order on all ranks
    measured: set[str] = set()  # the terms this objective computes (the same on every rank)
    tis_max = 0.0
    ages = batch.staleness if batch.staleness is not None else [0] * len(batch)
    sample_weights = staleness_weights(ages, settings.staleness, settings.staleness_decay, settings.drop_older_than)
    token_weights = _token_weights(trainer, batch, sample_weights)
    grad_norms = []
    trainer.routing_agreement.reset()
    # The ratio's denominator is the policy the engines ran: the weights as pushed, whatever the forward uses.
    old_logprobs = trainer._padded_logprobs(batch, as_pushed=True) if trainer._recompute_old else None
    old_values = trainer._padded_values(batch) if trainer.critic is not None else None
    whole = collate(batch, trainer.pad_token_id)  # the batch collated once: advantages, masks of the metrics
    advantages, targets, frozen_kl = _advantages(trainer, batch, whole, old_logprobs, old_values)
    critic_sums, critic_norms = dict.fromkeys(CRITIC_SUMS, 0.0), []
    before = [p.detach().clone() for p in trainer._param_shards()] if trainer.push_dtype is not None else None
    skips = trainer.backend.overflow_skips
    diffs: list[torch.Tensor] = []  # |trainer − engine| logprob of every token, for the p99
    terms = trainer.objective.loss_terms(
        settings, kl_in_loss=not trainer.kl_in_reward, reference=trainer.reference is not None
    )
    objective = 0.0  # this rank's part of the aggregated loss, summed over minibatches
    for rows in minibatches:
        # Counts of this minibatch over all ranks: the denominators of the aggregation.
        counts = denominators([batch.loss_mask[i] for i in rows])
        local = [rows[i] for i in trainer._my_rows(len(rows))]
        c = trainer._collate(batch.select(local))
        with trainer._weights_for_forward():
            part = _minibatch_loss(
                trainer, terms, batch, c, local, counts, advantages, token_weights, old_logprobs, diffs
            )
        norm = trainer.backend.step_optimizer()
        trainer.backend.zero_grad()
        if norm is not None:
            grad_norms.append(norm)
        if trainer.critic is not None:  # the critic's step on the same rows, against the returns at rollout
            assert targets is not None and old_values is not None
            width = c.loss_mask.shape[1]
            for key, value in trainer.critic.minibatch_backward(
                c, targets[local][:, :width].to(trainer.device), old_values[local][:, :width].to(trainer.device),
                counts[0],
            ).items():  # fmt: skip
                critic_sums[key] += value
            critic_norms.append(trainer.critic.step())
        tis_max = max(tis_max, part.pop("tis_max"))
        objective += part.pop("objective")
        for key, value in part.items():
            sums[key] += value
            measured.add(key)
    total_tokens = float(batch.num_response_tokens)
    *reduced, objective = _reduce(trainer, [*sums.values(), objective])
    trainer.step += 1
    metrics = {f"train/{k}": v / max(total_tokens, 1.0) for k, v in zip(sums, reduced, strict=True) if k in measured}
    metrics["train/objective"] = objective / len(minibatches)
    if grad_norms:  # none when every minibatch's step was skipped (fp16 overflow): unmeasured, not 0.0
        metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["train/num_tokens"] = total_tokens
    full_mask = whole.loss_mask
    metrics["train/advantage_abs_mean"] = float((advantages.abs() * full_mask).sum() / full_mask.sum().clamp(min=1))
    if trainer.critic is not None:
        assert targets is not None and old_values is not None
        metrics.update(
            _critic_metrics(trainer, critic_sums, critic_norms, targets, old_values, full_mask, total_tokens)
        )
    if frozen_kl is not None:
        metrics["train/teacher_kl"] = frozen_kl  # mean over the batch's tokens of log π_old − log π_teacher
    tis_max = _reduce(trainer, [tis_max], op=dist.ReduceOp.MAX)[0]  # every rank joins the collective
    if "tis" in measured:
        metrics["train/tis_max"] = tis_max
    metrics["train/sample_weight_mean"] = float(sample_weights.mean())
    if batch.token_staleness is not None:  # partial rollouts: the weight of the tokens, each by its own age
        metrics["train/token_weight_mean"] = float((token_weights * full_mask).sum() / full_mask.sum().clamp(min=1))
    metrics["train/logprob_diff_p99"] = quantile(trainer.world_size, trainer.backend.dp_rank, diffs, 0.99)
    if batch.routed_experts is not None:  # every rank has the field: the engine's routing came with the batch
        same, total = _reduce(trainer, [trainer.routing_agreement.same, trainer.routing_agreement.total])
        if total:
            metrics["train/routing_agreement"] = same / total
    if trainer.config.precision == "fp16":
        metrics["train/overflow_skipped"] = float(trainer.backend.overflow_skips - skips)
    if before is not None:
        assert trainer.push_dtype is not None
        metrics["train/update_kept_frac"] = update_kept(
            trainer.model, before, trainer.push_dtype, trainer.backend.replicas, trainer.device
        )
    return metrics


def _minibatch_loss(
    trainer: Trainer,
    terms: LossTerms,
    batch: TrainBatch,
    c: Collated,
    local: list[int],
    counts: tuple[float, float],
    advantages: torch.Tensor,
    token_weights: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    diffs: list[torch.Tensor],
) -> dict[str, float]:
    """Forward and backward of this rank's rows of one minibatch: the objective's loss terms, combined and
    aggregated; the masked metric sums, tis_max and this rank's part of the aggregated loss (`objective`)."""
    settings = trainer.config.algorithm
    logprobs, entropy = trainer._token_logprobs(
        trainer.model, c, batch.temperature, with_entropy=True, entropy_grad=settings.entropy_coef > 0
    )
    assert entropy is not None
    width = c.loss_mask.shape[1]  # the whole batch is padded wider than this rank's part: trim the right padding
    old = c.rollout_logprobs if old_logprobs is None else old_logprobs[local][:, :width].to(trainer.device)
    ref = None
    if terms.needs_reference:
        with torch.no_grad():
            ref, _ = trainer._token_logprobs(trainer.reference, c, batch.temperature)
    inputs = TermInputs(
        policy=LossInputs(
            logprobs=logprobs,
            old_logprobs=old.detach(),
            advantages=advantages[local][:, :width].to(trainer.device),
            mask=c.loss_mask,
            clip_low=settings.clip_eps,
            clip_high=settings.clip_eps if settings.clip_eps_high is None else settings.clip_eps_high,
            dual_clip=settings.dual_clip,
        ),
        rollout_logprobs=c.rollout_logprobs,
        entropy=entropy,
        token_weights=token_weights[local][:, :width].to(trainer.device),
        ref_logprobs=ref,
    )
    per_token, policy, parts = agreed(trainer.world_size, lambda: terms.combine(inputs))
    loss = aggregate(per_token, c.loss_mask, trainer.aggregation, *counts)
    trainer.backend.backward(loss * trainer.backend.loss_scale)
    m = c.loss_mask
    diff = (logprobs - c.rollout_logprobs).detach()
    diffs.append(diff.abs()[m.bool()].cpu())
    tis = parts.get("tis")
    sums = {
        "tis_max": float((tis * m).max()) if tis is not None else 0.0,  # reported only where tis is on
        "objective": float(loss.detach()),
    }
    values = {
        "loss": per_token,
        "pg_loss": policy,
        "entropy": entropy,
        "ratio": torch.exp(logprobs - old),
        "logprob_diff": diff.abs(),
        # k3 estimate of KL(engine ‖ trainer) from the engine's samples: r − 1 − log r, r = π_trainer/π_engine
        "mismatch_k3": diff.exp() - 1 - diff,
        **parts,
    }
    with torch.no_grad():
        for key in METRIC_SUMS:  # a term that is off is not measured: it has no sum (and no metric)
            value = values.get(key)
            if value is not None:
                sums[key] = float((value.detach() * m).sum())
    return sums


def _critic_metrics(
    trainer: Trainer,
    sums: dict[str, float],
    norms: list[float],
    targets: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    total_tokens: float,
) -> dict[str, float]:
    """train/value_loss, value_clipfrac, value_pred (token means over minibatches, all ranks), critic_grad_norm,
    and of the values at rollout: value_mean, return_mean and explained_variance 1 − Var(R − V) / Var(R)."""
    reduced = _reduce(trainer, list(sums.values()))
    metrics = {f"train/{k}": v / max(total_tokens, 1.0) for k, v in zip(sums, reduced, strict=True)}
    metrics["train/critic_grad_norm"] = sum(norms) / len(norms)  # before clipping, the mean over minibatches
    on = mask.bool()
    returns, predicted = targets[on].double(), values[on].double()
    metrics["train/value_mean"] = float(predicted.mean()) if predicted.numel() else 0.0
    metrics["train/return_mean"] = float(returns.mean()) if returns.numel() else 0.0
    spread = float(returns.var()) if returns.numel() > 1 else 0.0
    if spread > 0:
        metrics["train/explained_variance"] = 1.0 - float((returns - predicted).var()) / spread
    return metrics
