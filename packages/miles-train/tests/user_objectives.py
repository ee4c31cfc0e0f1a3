"""User objectives for the tests, imported by dotted path (`user_objectives:Name`) in the rank processes."""

import torch

from miles_train.objectives import AdvantageInputs, LossInputs, Objective, group_baseline_advantages


class ScaledGRPO(Objective):
    """GRPO's advantages times `scale`, the clipped ratio loss: a user objective with an option."""

    name = "scaled_grpo"

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def advantages(self, inputs: AdvantageInputs) -> torch.Tensor:
        return self.scale * group_baseline_advantages(inputs.rewards, inputs.group_index, "std")


class NaNLoss(ScaledGRPO):
    def policy_loss(self, inputs: LossInputs):
        loss, clipped = super().policy_loss(inputs)
        return loss * torch.nan, clipped


class DetachedLoss(ScaledGRPO):
    def policy_loss(self, inputs: LossInputs):
        loss, clipped = super().policy_loss(inputs)
        return loss.detach(), clipped


class WrongShapeAdvantages(ScaledGRPO):
    def advantages(self, inputs: AdvantageInputs) -> torch.Tensor:
        return torch.zeros(len(inputs.rewards) + 1)


class NotAnObjective:
    pass
