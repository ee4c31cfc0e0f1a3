"""A two-turn environment for the capitals task on a real model (`rollout.environment: capitals_env:Retry`).

The Instruct model answers "What is the capital of X? Answer with the city's name only."; an answer that is not
exactly the capital gets a second user turn, rendered with the model's chat template like the first ("That is not
it: …" or, when the answer names the city among other words, "Only the city's name, please."). Reward: the
`capitals_reward.score` of the first answer, or `retry_reward` × that of the second. A plug-in module
beside its job file, found without PYTHONPATH (as the reward is).
"""

from __future__ import annotations

from capitals_reward import score

from miles_rollout.env import Action, StepResult
from miles_rollout.types import PromptRecord


class Retry:
    """One episode (a new one per episode): up to `tries` answers."""

    def __init__(self, tries: int = 2, retry_reward: float = 0.5) -> None:
        if tries < 1:
            raise ValueError(f"tries: {tries} (at least 1)")
        self.tries, self.retry_reward = tries, retry_reward
        self.record: PromptRecord | None = None
        self.attempt = 0

    def reset(self, record: PromptRecord) -> None:
        self.record, self.attempt = record, 0
        return None  # the prompt is the first user turn

    def step(self, action: Action) -> StepResult:
        assert self.record is not None, "step() before reset()"
        self.attempt += 1
        points = score(action.text, self.record.label)
        scale = 1.0 if self.attempt == 1 else self.retry_reward
        if points == 1.0 or self.attempt >= self.tries:
            return StepResult(reward=scale * points, done=True)
        if points > 0:
            return StepResult(observation="Only the city's name, please.", reward=0.0)
        return StepResult(observation="That is not it. Think again: which city is the capital? Only its name.")
