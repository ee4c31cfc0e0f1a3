"""GRPO maths against values computed by hand."""

import math

import pytest
import torch

from miles_train.collate import collate
from miles_train.grpo import (
    clipped_policy_loss,
    group_advantages,
    kl_k3,
    staleness_weights,
    token_mean,
    truncated_is_weights,
)
from miles_train.types import TrainBatch


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
    assert torch.allclose(kl_k3(lp, ref), torch.tensor([0.0, math.exp(0.5) - 1.5]))


def test_token_mean_global_denominator():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    assert token_mean(values, mask).item() == pytest.approx((1 + 2 + 5 + 6) / 4)
    assert token_mean(values, mask, num_tokens=8).item() == pytest.approx(14 / 8)


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

    from miles_train.config import GRPOConfig

    with pytest.raises(ValidationError, match="tis_cap needs the trainer's old-policy logprobs"):
        GRPOConfig(tis_cap=2.0, old_logprobs="rollout")
    assert GRPOConfig(tis_cap=2.0, old_logprobs="recompute").tis_cap == 2.0
    assert GRPOConfig(tis_cap=2.0).old_logprobs == "auto"  # auto recomputes when tis_cap is set
