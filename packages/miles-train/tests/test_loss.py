"""The loss terms and the group advantages against values computed by hand; the terms' composition; old specs."""

import math

import pytest
import torch

from miles_train.collate import collate
from miles_train.config import AlgorithmConfig, TrainConfig
from miles_train.loss import (
    EntropyBonus,
    KLPenalty,
    LossInputs,
    LossTerms,
    MaskedIS,
    TermInputs,
    TruncatedIS,
    aggregate,
    kl_estimate,
    ppo_clip,
    staleness_term,
    staleness_weights,
    truncated_is_weights,
)
from miles_train.objectives import build_objective, group_baseline_advantages
from miles_train.types import TrainBatch


def group_advantages(rewards, group_index, normalize_std=True):
    return group_baseline_advantages(rewards, group_index, "std" if normalize_std else "mean").float()


def clipped_policy_loss(logprobs, old, adv, clip_eps, clip_eps_high=None):
    ratio = torch.exp(logprobs - old)
    loss, clipped = ppo_clip(ratio, adv, clip_eps, clip_eps if clip_eps_high is None else clip_eps_high)
    return loss, ratio, clipped


def test_group_advantages_by_hand():
    # group 0: rewards 1,0,0,1 → mean 0.5, unbiased std sqrt(1/3) → ±0.5·sqrt(3)
    # group 1: rewards 1,1 → all equal → 0; group 2: one sample → 0
    adv = group_advantages([1, 0, 0, 1, 1, 1, 0.3], [0, 0, 0, 0, 1, 1, 2])
    half_sqrt3 = 0.5 * math.sqrt(3)
    expected = [half_sqrt3, -half_sqrt3, -half_sqrt3, half_sqrt3, 0, 0, 0]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-5)


def test_group_advantages_without_std():
    adv = group_advantages([2.0, 0.0, 1.0], [5, 5, 5], normalize_std=False)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0]))


def test_clipped_loss_by_hand():
    old = torch.zeros(4)
    logprobs = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.7]))  # ratios 1.5, 0.5, 1.1, 0.7
    adv = torch.tensor([1.0, 1.0, -2.0, -2.0])
    loss, ratio, clipped = clipped_policy_loss(logprobs, old, adv, clip_eps=0.2)
    # A>0, ρ=1.5: min(1.5, 1.2)=1.2 → -1.2 (clipped); A>0, ρ=0.5: min(0.5, 0.8)=0.5 → -0.5
    # A<0, ρ=1.1: min(-2.2, -2.2)=-2.2 → 2.2; A<0, ρ=0.7: min(-1.4, -1.6)=-1.6 → 1.6 (clipped)
    assert torch.allclose(loss, torch.tensor([-1.2, -0.5, 2.2, 1.6]), atol=1e-6)
    assert torch.allclose(ratio, torch.tensor([1.5, 0.5, 1.1, 0.7]), atol=1e-6)
    assert clipped.tolist() == [True, False, False, True]


def test_asymmetric_clip():
    loss, _, _ = clipped_policy_loss(
        torch.log(torch.tensor([1.5])), torch.zeros(1), torch.ones(1), clip_eps=0.2, clip_eps_high=0.28
    )
    assert loss.item() == pytest.approx(-1.28)


def test_clipped_loss_gradient_vanishes_when_clipped():
    logprobs = torch.log(torch.tensor([1.5, 1.0])).requires_grad_()
    loss, _, _ = clipped_policy_loss(logprobs, torch.zeros(2), torch.ones(2), clip_eps=0.2)
    loss.sum().backward()
    assert logprobs.grad.tolist() == pytest.approx([0.0, -1.0])  # d(-ρ)/dlogπ = -ρ = -1


def test_kl_k3_by_hand():
    lp, ref = torch.tensor([0.0, -1.0]), torch.tensor([0.0, -0.5])
    # Δ = ref − lp = 0, 0.5 → e^0−0−1 = 0; e^0.5−0.5−1
    assert torch.allclose(kl_estimate(lp, ref, "k3"), torch.tensor([0.0, math.exp(0.5) - 1.5]))


def test_token_mean_global_denominator():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    assert aggregate(values, mask, "token_mean", 4, 2).item() == pytest.approx((1 + 2 + 5 + 6) / 4)
    assert aggregate(values, mask, "token_mean", 8, 2).item() == pytest.approx(14 / 8)  # the global batch's count


def test_aggregation_ignores_nan_off_the_mask():
    values = torch.tensor([[1.0, float("nan")], [float("inf"), 3.0]])
    mask = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        assert math.isfinite(aggregate(values, mask, mode, 2, 2).item()), mode


def test_collate_aligns_response_tokens():
    batch = TrainBatch(
        input_ids=[[5, 6, 7, 8], [9, 10, 11]],
        response_start=[2, 1],
        rollout_logprobs=[[-0.1, -0.2], [-0.3, -0.4]],
        loss_mask=[[1, 1], [1, 0]],
        rewards=[1.0, 0.0],
        group_index=[0, 0],
    )
    c = collate(batch)
    # row 0: tokens 7, 8 are predicted at positions 1, 2
    assert c.targets[0].tolist() == [6, 7, 8]
    assert c.loss_mask[0].tolist() == [0, 1, 1]
    assert c.rollout_logprobs[0].tolist() == pytest.approx([0, -0.1, -0.2])
    # row 1: right-padded; tokens 10, 11 predicted at positions 0, 1; the second is masked out
    assert c.loss_mask[1].tolist() == [1, 0, 0]
    assert c.attention_mask[1].tolist() == [1, 1, 1, 0]


def test_train_batch_rejects_ragged_rows():
    with pytest.raises(ValueError, match="row 0: 2 response tokens but 1 logprobs"):
        TrainBatch(
            input_ids=[[1, 2, 3]],
            response_start=[1],
            rollout_logprobs=[[0.0]],
            loss_mask=[[1, 1]],
            rewards=[0.0],
            group_index=[0],
        )


def test_truncated_is_weights_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    rollout = torch.log(torch.tensor([[0.25, 0.4, 0.1]]))
    weights, truncated = truncated_is_weights(old, rollout, cap=2.0)
    assert torch.allclose(weights, torch.tensor([[2.0, 0.5, 2.0]]))  # ratios 2, 0.5, 9 → capped at 2
    assert truncated.tolist() == [[False, False, True]]


def test_staleness_weights_by_hand():
    assert staleness_weights([0, 1, 3], "none", 0.5, 1).tolist() == [1.0, 1.0, 1.0]
    assert staleness_weights([0, 1, 3], "decay", 0.5, 1).tolist() == [1.0, 0.5, 0.125]
    assert staleness_weights([0, 1, 3], "drop", 0.5, 1).tolist() == [1.0, 1.0, 0.0]


def test_tis_needs_recomputed_old_logprobs():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="tis_cap needs the trainer's old-policy logprobs"):
        AlgorithmConfig(tis_cap=2.0, old_logprobs="rollout")
    assert AlgorithmConfig(tis_cap=2.0, old_logprobs="recompute").tis_cap == 2.0
    assert AlgorithmConfig(tis_cap=2.0).old_logprobs == "auto"  # auto recomputes when tis_cap is set


# ---- the terms' composition -------------------------------------------------------------------------------------
def term_inputs(reference: bool = True) -> TermInputs:
    g = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(2, 3, generator=g)).requires_grad_()
    policy = LossInputs(
        logprobs=logprobs,
        old_logprobs=-torch.rand(2, 3, generator=g),
        advantages=torch.tensor([[1.0] * 3, [-1.0] * 3]),
        mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
        clip_low=0.2,
        clip_high=0.2,
    )
    return TermInputs(
        policy=policy,
        rollout_logprobs=-torch.rand(2, 3, generator=g),
        entropy=torch.rand(2, 3, generator=g),
        token_weights=torch.tensor([[1.0] * 3, [0.5] * 3]),
        ref_logprobs=-torch.rand(2, 3, generator=g) if reference else None,
    )


def test_standard_terms_follow_the_settings():
    objective = build_objective(AlgorithmConfig())
    plain = LossTerms.standard(objective, AlgorithmConfig(), kl_in_loss=True, reference=False)
    assert plain.weights == [staleness_term] and plain.penalties == []
    settings = AlgorithmConfig(tis_cap=2.0, mis_band=(0.5, 2.0), kl_coef=0.1, entropy_coef=0.01)
    full = LossTerms.standard(objective, settings, kl_in_loss=True, reference=True)
    assert [type(w) for w in full.weights[:2]] == [TruncatedIS, MaskedIS] and full.weights[2] is staleness_term
    assert [type(p) for p in full.penalties] == [KLPenalty, EntropyBonus] and full.needs_reference
    # without a reference model there is no KL term, whatever kl_coef says
    assert not LossTerms.standard(objective, settings, kl_in_loss=True, reference=False).needs_reference


def test_combined_loss_is_the_formula():
    """policy × TIS × MIS × staleness + kl_coef·KL − entropy_coef·H, token by token."""
    x = term_inputs()
    objective = build_objective(AlgorithmConfig())
    settings = AlgorithmConfig(tis_cap=1.5, mis_band=(0.4, 3.0), kl_coef=0.1, entropy_coef=0.01)
    per_token, policy, metrics = LossTerms.standard(objective, settings, kl_in_loss=True, reference=True).combine(x)
    p = x.policy
    pg, _ = ppo_clip(torch.exp(p.logprobs - p.old_logprobs), p.advantages, 0.2, 0.2)
    ratio = torch.exp(p.old_logprobs - x.rollout_logprobs)
    weighted = pg * ratio.clamp(max=1.5) * ((ratio >= 0.4) & (ratio <= 3.0)).float() * x.token_weights
    kl = kl_estimate(p.logprobs, x.ref_logprobs, "k3")
    assert torch.allclose(policy, weighted)
    assert torch.allclose(per_token, weighted + 0.1 * kl - 0.01 * x.entropy)
    assert set(metrics) == {"clipfrac", "tis", "tis_clipfrac", "mis_dropfrac", "kl"}
    # KL in the reward: reported, not in the loss
    in_reward = LossTerms.standard(objective, settings, kl_in_loss=False, reference=True).combine(x)
    assert torch.allclose(in_reward[0], weighted - 0.01 * x.entropy) and torch.equal(in_reward[2]["kl"], kl)


def test_an_objective_combines_its_own_terms():
    """An objective that overrides loss_terms drops the corrections; its loss is its policy term alone."""
    from miles_train.objectives import GRPO

    class Uncorrected(GRPO):
        name = "uncorrected"

        def loss_terms(self, settings, *, kl_in_loss, reference):
            terms = super().loss_terms(settings, kl_in_loss=kl_in_loss, reference=reference)
            terms.weights = []
            return terms

    x = term_inputs(reference=False)
    settings = AlgorithmConfig(tis_cap=1.5)
    per_token, _, metrics = Uncorrected().loss_terms(settings, kl_in_loss=True, reference=False).combine(x)
    p = x.policy
    assert torch.allclose(per_token, ppo_clip(torch.exp(p.logprobs - p.old_logprobs), p.advantages, 0.2, 0.2)[0])
    assert "tis" not in metrics


# ---- one settings section; old specs --------------------------------------------------------------------------
def test_a_spec_with_train_grpo_still_loads_with_a_warning():
    with pytest.warns(FutureWarning, match=r"grpo.kl_coef → algorithm.kl_coef"):
        config = TrainConfig.model_validate(
            {"algorithm": "gspo", "grpo": {"kl_coef": 0.1, "staleness_max": 3, "loss_aggregation": "token_mean"}}
        )
    algorithm = config.algorithm
    assert (algorithm.name, algorithm.kl_coef, algorithm.drop_older_than) == ("gspo", 0.1, 3)
    assert "grpo" not in config.model_dump()


def test_grpo_and_algorithm_that_disagree_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"grpo.clip_eps \(0.3\) and algorithm.clip_eps \(0.2\) disagree"):
        TrainConfig.model_validate({"algorithm": {"clip_eps": 0.2}, "grpo": {"clip_eps": 0.3}})
