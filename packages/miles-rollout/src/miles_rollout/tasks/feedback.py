"""A two-turn arithmetic task with environment feedback: the model answers; when it is wrong the environment says
whether the answer is too high or too low and asks again.

`"37+58="` → the model writes `"97"` → the environment answers `"-37+58="` (lower; `+` means higher, `=` that the
answer was not a number) → the model tries again. Reward: 1 for a right first answer, `retry_reward` for a right
second one, 0 otherwise. The hint is in the task's own characters, so the built-in arithmetic model can read it;
it is a learnable signal (the second answer should move the way the hint says).

    rollout:
      generate: multi_turn
      environment: miles_rollout.tasks.feedback:ArithmeticFeedback
      reward: env
"""

from __future__ import annotations

from miles_rollout.env import Action, StepResult
from miles_rollout.types import PromptRecord


class ArithmeticFeedback:
    """One episode of the feedback task (a new one per episode)."""

    def __init__(self, tries: int = 2, retry_reward: float = 0.5) -> None:
        if tries < 1:
            raise ValueError(f"tries: {tries} (at least 1)")
        self.tries, self.retry_reward = tries, retry_reward
        self.record: PromptRecord | None = None
        self.attempt = 0

    def reset(self, record: PromptRecord) -> None:
        self.record, self.attempt = record, 0
        return None  # the prompt itself is the first observation

    def step(self, action: Action) -> StepResult:
        assert self.record is not None, "step() before reset()"
        self.attempt += 1
        answer, label = action.text.strip(), self.record.label.strip()
        if answer == label:
            return StepResult(reward=1.0 if self.attempt == 1 else self.retry_reward, done=True)
        if self.attempt >= self.tries:
            return StepResult(reward=0.0, done=True)
        try:
            hint = "-" if int(answer) > int(label) else "+"
        except ValueError:
            hint = "="
        return StepResult(observation=hint + self.record.prompt, reward=0.0)
