"""The objectives (train.algorithm) against values computed by hand from each paper's formula, the aggregation
modes under splits, and what a user objective that returns nonsense gets told."""

import math
import sys
from pathlib import Path

import pytest
import torch

from miles_train.config import TrainConfig
from miles_train.loss import (
    LossInputs,
    ObjectiveError,
    aggregate,
    check_loss,
    denominators,
    kl_estimate,
    ppo_clip,
    value_loss,
)
from miles_train.objectives import (
    BUILTINS,
    GSPO,
    AdvantageInputs,
    build_objective,
    check_advantages,
    gae,
    group_baseline_advantages,
    token_rewards,
    whiten,
)

sys.path.insert(0, str(Path(__file__).parent))  # user_objectives.py, by dotted path


def advantages(name: str, rewards, groups, mask=None, kl_penalty=None, normalize_std=True) -> torch.Tensor:
    mask = torch.ones(len(rewards), 3) if mask is None else mask
    inputs = AdvantageInputs(torch.tensor(rewards, dtype=torch.float64), groups, mask, kl_penalty, normalize_std)
    return BUILTINS[name]().advantages(inputs)


# distill's advantages are not from rewards, ppo's baseline is its critic (tested below)
@pytest.mark.parametrize("name", sorted(set(BUILTINS) - {"distill", "ppo"}))
def test_all_equal_fractional_rewards_give_exactly_zero(name):
    """Eight samples of 0.7: in fp32 their std is ~1e-8, and dividing by it plus 1e-6 gave |A| up to 0.056."""
    r = torch.full((8,), 0.7)
    assert float(r.std()) > 0 and float(((r - r.mean()) / (r.std() + 1e-6)).abs().max()) > 0.01  # the old formula
    adv = advantages(name, [0.7] * 8, [0] * 8)
    assert torch.count_nonzero(adv) == 0, adv


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "gspo"])
def test_a_group_of_one_gets_zero(name):
    adv = advantages(name, [1.0, 0.0, 1.0], [0, 1, 1])
    assert adv[0] == 0 and adv[1] != 0


def test_grpo_and_dr_grpo_by_hand():
    # rewards 1,0,0,1: mean 0.5, unbiased std sqrt(1/3) → ±0.5·sqrt(3); Dr. GRPO: ±0.5
    adv = advantages("grpo", [1, 0, 0, 1], [0] * 4)
    h = 0.5 * math.sqrt(3)
    assert adv.tolist() == pytest.approx([h, -h, -h, h], abs=1e-5)
    assert advantages("dr_grpo", [1, 0, 0, 1], [0] * 4).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert advantages("grpo", [2.0, 0.0, 1.0], [5] * 3, normalize_std=False).tolist() == pytest.approx([1, -1, 0])
    assert group_baseline_advantages([0.7] * 8, [0] * 8, "std").abs().max() == 0


def test_rloo_by_hand():
    # r − mean of the others: 1 − (0 + 0.5)/2 = 0.75; 0 − 0.75 = −0.75; 0.5 − 0.5 = 0; the lone sample: 0
    adv = advantages("rloo", [1.0, 0.0, 0.5, 3.0], [0, 0, 0, 1])
    assert adv.tolist() == pytest.approx([0.75, -0.75, 0.0, 0.0])


def test_reinforce_pp_by_hand_with_a_masked_gap_and_kl_in_the_reward():
    # Row 0 trains tokens 0-2, row 1 tokens 0, 2, 3 (token 1 is a tool's turn). Every trained token's reward is
    # −0.1 (the KL penalty), the last also gets the sequence's reward (1 and 0). Returns to go:
    # row 0: 0.7, 0.8, 0.9; row 1: −0.3, (none), −0.2, −0.1. Whitened over these six values.
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 1, 1]])
    adv = advantages("reinforce_pp", [1.0, 0.0], [0, 1], mask, kl_penalty=torch.full((2, 4), 0.1))
    values = [0.7, 0.8, 0.9, -0.3, -0.2, -0.1]
    mean = sum(values) / 6
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / 5)
    expected = [[(v - mean) / (std + 1e-6) for v in values[:3]] + [0], [(values[3] - mean) / (std + 1e-6), 0]]
    expected[1] += [(v - mean) / (std + 1e-6) for v in values[4:]]
    assert adv.tolist() == [pytest.approx(row, abs=1e-6) for row in expected]  # the penalty is fp32 0.1
    # the baseline variant centres each group first: one group of both → rewards 0.5, −0.5
    base = advantages("reinforce_pp_baseline", [1.0, 0.0], [0, 0], mask)
    a = 0.5 / (math.sqrt(6 * 0.25 / 5) + 1e-6)  # returns ±0.5 on every trained token: mean 0, unbiased std
    assert base[mask.bool()].tolist() == pytest.approx([a, a, a, -a, -a, -a])
    assert base[~mask.bool()].abs().max() == 0


def test_kl_in_the_reward_of_a_sequence_algorithm_is_its_summed_penalty():
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    penalty = torch.tensor([[0.25, 0.5, 9.0], [0.0, 0.0, 0.75]])  # the 9 sits on an untrained token: ignored
    adv = advantages("dr_grpo", [1.0, 1.0], [0, 0], mask, kl_penalty=penalty)
    assert adv.tolist() == [0.0, 0.0]  # 1 − 0.75 both: equal, exactly 0
    adv = advantages("dr_grpo", [1.0, 0.5], [0, 0], mask, kl_penalty=penalty)
    assert adv.tolist() == pytest.approx([0.25, -0.25])


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-0.5, -2.0])  # Δ = 0.5, 0
    assert kl_estimate(lp, ref, "k1").tolist() == pytest.approx([-0.5, 0.0])
    assert kl_estimate(lp, ref, "k2").tolist() == pytest.approx([0.125, 0.0])
    assert kl_estimate(lp, ref, "k3").tolist() == pytest.approx([math.exp(0.5) - 1.5, 0.0])


def test_dual_clip_by_hand():
    ratio = torch.tensor([5.0, 2.0, 5.0, 0.5])
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0])
    loss, bit = ppo_clip(ratio, adv, 0.2, 0.2, dual_clip=3.0)
    # A<0, ρ=5: PPO gives 5, capped at 3·1; A<0, ρ=2: 2 < 3 stays; A>0, ρ=5: −1.2 (ordinary clip); ρ=0.5: 0.8
    assert loss.tolist() == pytest.approx([3.0, 2.0, -1.2, 0.8])
    assert bit.tolist() == [True, False, True, True]
    plain, _ = ppo_clip(ratio, adv, 0.2, 0.2)
    assert plain.tolist() == pytest.approx([5.0, 2.0, -1.2, 0.8])


def gspo_inputs(clip_high=0.2):
    logprobs = torch.tensor([[0.1, 0.3, 0.0], [-0.1, 0.0, 7.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 0]])
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    return LossInputs(logprobs, torch.zeros(2, 3), adv, mask, 0.2, clip_high), logprobs


def test_gspo_sequence_ratio_and_clip_by_hand():
    inputs, logprobs = gspo_inputs()
    loss, bit = GSPO().policy_loss(inputs)
    # row 0: s = exp((0.1 + 0.3)/2) = 1.2214 > 1.2, A = 1 → −1.2 (clipped, no gradient);
    # row 1: s = exp(−0.05) = 0.9512, A = −1 → 0.9512, d/dlogπ_t = s/2 on each of its 2 trained tokens
    s1 = math.exp(-0.05)
    assert loss.tolist() == [pytest.approx([-1.2] * 3), pytest.approx([s1] * 3)]
    assert bit[:, 0].tolist() == [True, False]
    total = aggregate(loss, inputs.mask, GSPO.aggregation, *denominators([[1, 1], [1, 1]]))
    assert float(total.detach()) == pytest.approx((-1.2 + s1) / 2)
    total.backward()
    assert logprobs.grad.tolist() == [pytest.approx([0, 0, 0]), pytest.approx([s1 / 4, s1 / 4, 0])]  # ÷2 sequences
    high, _ = gspo_inputs(clip_high=0.25)
    assert float(GSPO().policy_loss(high)[0][0, 0].detach()) == pytest.approx(-math.exp(0.2))  # asymmetric: inside


def test_aggregations_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 0, 0], [0, 1, 1], [0, 0, 0]])  # a row without trained tokens counts for nothing
    counts = denominators([[1, 0, 0], [0, 1, 1], [0, 0, 0]])
    assert counts == (3.0, 2.0)
    assert float(aggregate(values, mask, "token_mean", *counts)) == pytest.approx((1 + 5 + 6) / 3)
    assert float(aggregate(values, mask, "seq_mean_token_mean", *counts)) == pytest.approx((1 + 5.5) / 2)
    assert float(aggregate(values, mask, "seq_mean_token_sum", *counts)) == pytest.approx((1 + 11) / 2)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_aggregation_split_over_ranks_is_the_unsplit_loss_and_gradient(mode):
    torch.manual_seed(0)
    lengths = [[1, 1, 1, 0, 0], [1, 0, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    mask = torch.tensor(lengths, dtype=torch.float32)
    whole = torch.randn(5, 5, requires_grad=True)
    counts = denominators(lengths)
    aggregate(whole, mask, mode, *counts).backward()
    split = whole.detach().clone().requires_grad_()
    parts = [aggregate(split[r::2], mask[r::2], mode, *counts) for r in range(2)]  # rank r's rows, global counts
    sum(parts).backward()
    assert float(sum(parts).detach()) == pytest.approx(float(aggregate(whole, mask, mode, *counts).detach()), abs=1e-6)
    assert torch.allclose(split.grad, whole.grad, atol=1e-7)


def test_config_names_and_errors():
    assert TrainConfig.model_validate({"algorithm": "gspo"}).algorithm.name == "gspo"
    with pytest.raises(ValueError, match="unknown algorithm 'ppo2'.*grpo, dr_grpo"):
        TrainConfig.model_validate({"algorithm": "ppo2"})
    with pytest.raises(ValueError, match="takes no options"):
        TrainConfig.model_validate({"algorithm": {"name": "rloo", "options": {"scale": 2}}})
    with pytest.raises(ValueError, match="dual_clip"):
        TrainConfig.model_validate({"algorithm": {"dual_clip": 0.5}})
    with pytest.raises(ValueError, match="train.critic is the value model of algorithm ppo; this job's is rloo"):
        TrainConfig.model_validate({"algorithm": "rloo", "critic": {"lr": 1e-5}})
    with pytest.raises(ValueError, match="lam"):
        TrainConfig.model_validate({"algorithm": "ppo", "critic": {"lam": 1.5}})
    ppo = TrainConfig.model_validate({"algorithm": "ppo"})
    assert ppo.critic is None and ppo.critic_config.lam == 0.95 and build_objective(ppo.algorithm).needs_values
    config = TrainConfig.model_validate({"algorithm": {"name": "user_objectives:ScaledGRPO", "options": {"scale": 2}}})
    assert build_objective(config.algorithm).scale == 2


def test_a_user_objective_is_checked_when_built():
    def build(name, **options):
        return build_objective(TrainConfig.model_validate({"algorithm": {"name": name, "options": options}}).algorithm)

    with pytest.raises(ValueError, match="not a subclass of miles_train.objectives.Objective"):
        build("user_objectives:NotAnObjective")
    with pytest.raises(ValueError, match="does not take"):
        build("user_objectives:ScaledGRPO", temperature=3)
    with pytest.raises(ValueError, match="no attribute 'Missing'"):
        build("user_objectives:Missing")


def test_what_a_user_objective_returns_is_checked_with_its_name():
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0]])
    with pytest.raises(ObjectiveError, match=r"objective mine: advantages have shape \(3,\); expected \(2,\)"):
        check_advantages("mine", torch.zeros(3), 2, 3, mask)
    with pytest.raises(ObjectiveError, match="advantage of sample 1 token 0 is nan"):
        check_advantages("mine", torch.tensor([0.0, math.nan]), 2, 3, mask)
    assert check_advantages("mine", torch.tensor([[1.0, 2, math.nan], [0, 0, 0]]), 2, 3, mask).shape == (2, 3)
    logprobs = torch.zeros(2, 3, requires_grad=True)
    clipped = torch.zeros(2, 3, dtype=torch.bool)
    with pytest.raises(ObjectiveError, match=r"policy loss has shape \(2,\); expected \(2, 3\)"):
        check_loss("mine", (logprobs.sum(1), clipped), logprobs, mask, values=True)
    with pytest.raises(ObjectiveError, match="has no gradient"):
        check_loss("mine", (torch.zeros(2, 3), clipped), logprobs, mask, values=True)
    with pytest.raises(ObjectiveError, match=r"policy loss \(2, 3\) is inf at row 0 token 1"):
        check_loss("mine", (logprobs + torch.tensor([[0, math.inf, 0], [0, 0, 0]]), clipped), logprobs, mask, True)
    with pytest.raises(ObjectiveError, match="must return"):
        check_loss("mine", logprobs, logprobs, mask, values=True)


def test_sft_is_the_negative_log_likelihood_of_the_responses():
    logprobs = torch.tensor([[-0.5, -1.5, -9.0], [-2.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0]])
    inputs = LossInputs(logprobs, torch.zeros(2, 3), torch.zeros(2, 3), mask, 0.2, 0.2)
    loss, clipped = BUILTINS["sft"]().policy_loss(inputs)
    total = aggregate(loss, mask, "token_mean", *denominators([[1, 1], [1]]))
    assert float(total.detach()) == pytest.approx((0.5 + 1.5 + 2.0) / 3) and not clipped.any()
    total.backward()
    assert logprobs.grad.tolist() == [pytest.approx([-1 / 3, -1 / 3, 0]), pytest.approx([-1 / 3, 0, 0])]


def test_distill_advantages_are_the_teachers_logprob_less_the_students_per_token():
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 1]])
    old = torch.tensor([[-1.0, -2.0, -5.0], [-0.5, -9.0, -3.0]])
    teacher = torch.tensor([[-0.25, -3.0, -1.0], [-0.5, 0.0, -1.0]])
    inputs = AdvantageInputs(torch.zeros(2, dtype=torch.float64), [0, 0], mask, None)
    with pytest.raises(ValueError, match="teacher's logprobs are missing"):
        BUILTINS["distill"]().advantages(inputs)
    inputs.old_logprobs, inputs.ref_logprobs = old, teacher
    adv = BUILTINS["distill"]().advantages(inputs)
    assert adv.tolist() == [[0.75, -1.0, 0.0], [0.0, 0.0, 2.0]]  # 0 off the mask (the tool turn, the padding)


def test_gae_by_hand_with_a_tool_turn_between_trained_tokens():
    """γ 0.9, λ 0.5. Row 0: three tokens, values 0.5, 0.6, 0.8, reward 1 at the last; δ = 0.04, 0.12, 0.2 and
    A = δ_t + 0.45 A_{t+1} = 0.1345, 0.21, 0.2. Row 1 trains tokens 0, 2, 3 (token 1 is a tool's turn, value 7, never
    a step): rewards −0.1 (a KL penalty) on each, 0.5 more at the last; A_3 = 0.3, A_2 = −0.41 + 0.45·0.3 = −0.275,
    A_0 = (−0.1 + 0.9·0.4 − 0.2) + 0.45·(−0.275) = −0.06375. Padding (value 9) and the tool turn get 0."""
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 1, 1]])
    values = torch.tensor([[0.5, 0.6, 0.8, 9.0], [0.2, 7.0, 0.4, 0.1]], dtype=torch.float64)
    rewards = token_rewards(torch.tensor([1.0, 0.5]), mask, torch.tensor([[0.0] * 4, [0.1] * 4]))
    adv, returns = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    assert adv.tolist() == [pytest.approx([0.1345, 0.21, 0.2, 0]), pytest.approx([-0.06375, 0, -0.275, 0.3])]
    assert returns.tolist() == [pytest.approx([0.6345, 0.81, 1.0, 0]), pytest.approx([0.13625, 0, 0.125, 0.4])]
    # λ = 1, γ = 1 and a zero critic: the returns to go (REINFORCE's), whatever the values would have been
    adv1, _ = gae(rewards, torch.zeros_like(values), mask, gamma=1.0, lam=1.0)
    assert adv1[1].tolist() == pytest.approx([0.2, 0, 0.3, 0.4])


def test_ppo_advantages_are_whitened_gae_and_its_targets_the_returns():
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 1, 1]])
    values = torch.tensor([[0.5, 0.6, 0.8, 0.0], [0.2, 0.0, 0.4, 0.1]], dtype=torch.float64)
    inputs = AdvantageInputs(torch.tensor([1.0, 0.5], dtype=torch.float64), [0, 1], mask, None, values=values)
    inputs.gamma, inputs.lam = 0.9, 0.5
    ppo = BUILTINS["ppo"]()
    raw, returns = gae(token_rewards(inputs.rewards, mask), values, mask, 0.9, 0.5)
    assert ppo.advantages(inputs).tolist() == whiten(raw, mask).tolist()
    assert ppo.value_targets(inputs).tolist() == returns.tolist()
    on = mask.bool()
    assert float(ppo.advantages(inputs)[on].mean()) == pytest.approx(0, abs=1e-9)
    # a critic that already predicts every return (γ = 1): every δ is 0, so every advantage is exactly 0
    inputs.values = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.5, 0.0, 0.5, 0.5]], dtype=torch.float64)
    inputs.gamma, inputs.lam = 1.0, 0.95
    assert torch.count_nonzero(ppo.advantages(inputs)) == 0
    inputs.values = None
    with pytest.raises(ValueError, match="critic's values are missing"):
        ppo.advantages(inputs)


def test_clipped_value_loss_by_hand():
    """V 1.0 from V_old 0.5 towards R 2: unclipped ½·1, clipped (0.5 + 0.2 − 2)² = 1.69 → ½·1.69, the clip bites;
    V 0 from 0.1 towards R 0: both 0, no clip."""
    values, old, returns = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.1]), torch.tensor([2.0, 0.0])
    loss, clipped = value_loss(values, old, returns, clip=0.2)
    assert loss.tolist() == pytest.approx([0.845, 0.0]) and clipped.tolist() == [True, False]
    loss, clipped = value_loss(values, old, returns, clip=None)
    assert loss.tolist() == pytest.approx([0.5, 0.0]) and not clipped.any()
