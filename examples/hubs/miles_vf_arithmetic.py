"""A `verifiers` environment (the classic API, `import verifiers as vf`) as a user would publish it: sums for the
built-in arithmetic model, scored by a rubric of two functions. `multi_turn=True` makes it a two-turn task: a wrong
first answer gets a hint ("-" too high, "+" too low) and the question again.

Miles loads it by id (`rollout.environment: {type: verifiers, id: miles_vf_arithmetic}`) from the job file's folder,
as it would load an environment installed with `vf-install`. Nothing here knows about Miles."""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset


def _sums(n: int, digits: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    rows = []
    for _ in range(n):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        rows.append({"question": f"{a}+{b}=", "answer": str(a + b)})
    return Dataset.from_list(rows)


def _text(message) -> str:
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", "")
    return (content or "").strip()


def correct(completion, answer) -> float:
    """1 when the last answer is the sum."""
    answers = [_text(m) for m in completion if (m.get("role") if isinstance(m, dict) else m.role) == "assistant"]
    return float(bool(answers) and answers[-1] == answer)


def first_try(completion, answer) -> float:
    """1 when the first answer already is the sum."""
    answers = [_text(m) for m in completion if (m.get("role") if isinstance(m, dict) else m.role) == "assistant"]
    return float(bool(answers) and answers[0] == answer)


def digits_only(completion) -> float:
    """1 when every answer is a number (a format check, weighted 0: reported, not rewarded)."""
    answers = [_text(m) for m in completion if (m.get("role") if isinstance(m, dict) else m.role) == "assistant"]
    return float(bool(answers) and all(a.isdigit() for a in answers))


class HintEnv(vf.MultiTurnEnv):
    """Two tries: after a wrong answer the environment says which way it is off and asks again."""

    def __init__(self, **kwargs):
        super().__init__(max_turns=2, **kwargs)

    @vf.stop
    async def answered_right(self, state) -> bool:
        trajectory = state["trajectory"]
        return bool(trajectory) and _text(trajectory[-1]["completion"][-1]) == state["answer"]

    async def env_response(self, messages, state, **kwargs):
        guess, question = _text(messages[-1]), _text(state["prompt"][-1])
        hint = "-" if guess.isdigit() and int(guess) > int(state["answer"]) else "+"
        return [{"role": "user", "content": hint + question}]


def load_environment(
    num_train: int = 2000, num_eval: int = 300, digits: int = 2, multi_turn: bool = False, seed: int = 0
) -> vf.Environment:
    train, held_out = _sums(num_train, digits, seed), _sums(num_eval, digits, seed + 1)
    if multi_turn:  # 1 for a right first answer, 0.5 for a right second one
        rubric = vf.Rubric(funcs=[correct, first_try, digits_only], weights=[0.5, 0.5, 0.0])
        return HintEnv(dataset=train, eval_dataset=held_out, rubric=rubric)
    rubric = vf.Rubric(funcs=[correct, digits_only], weights=[1.0, 0.0])
    return vf.SingleTurnEnv(dataset=train, eval_dataset=held_out, rubric=rubric)
