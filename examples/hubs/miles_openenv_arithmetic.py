"""An OpenEnv environment server (PyPI `openenv`) as a user would write one: sums for the built-in arithmetic model,
one question per session, two tries, reward 1 for a right first answer and 0.5 for a right second one.

Miles starts it itself (`rollout.environment: {type: openenv, app: miles_openenv_arithmetic:app}`), or it runs on
its own: `uvicorn miles_openenv_arithmetic:app --port 8000`. Nothing here knows about Miles."""

from __future__ import annotations

import random
import uuid

from openenv.core.env_server import Action, Environment, Observation, State, create_app


class SumAction(Action):
    message: str


class SumObservation(Observation):
    question: str = ""


class SumEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
        self.a = self.b = 0

    def reset(self, seed=None, episode_id=None, digits: int = 2, **kwargs) -> SumObservation:
        rng = random.Random(seed)
        lo, hi = 10 ** (digits - 1), 10**digits - 1
        self.a, self.b = rng.randint(lo, hi), rng.randint(lo, hi)
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return SumObservation(question=f"{self.a}+{self.b}=", done=False, reward=0.0)

    def step(self, action: SumAction, timeout_s=None, **kwargs) -> SumObservation:
        self._state.step_count += 1
        guess, answer = action.message.strip(), self.a + self.b
        if guess == str(answer):
            return SumObservation(question="", done=True, reward=1.0 if self._state.step_count == 1 else 0.5)
        if self._state.step_count >= 2:
            return SumObservation(question="", done=True, reward=0.0)
        hint = "-" if guess.isdigit() and int(guess) > answer else "+"
        return SumObservation(question=f"{hint}{self.a}+{self.b}=", done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(SumEnvironment, SumAction, SumObservation, env_name="miles_sums", max_concurrent_envs=64)
