"""A `verifiers` tool environment (`vf.ToolEnv`) as a user would publish it: 2-digit multiplications and a calculator
tool, for the built-in calculator model (`tiny-qwen2-calculator`, which writes its calls as `<call>37*58</call>`).

The tool is a plain Python function; verifiers turns it into the OpenAI tool definition, calls it with the
arguments of each tool call and ends the episode at the first answer without a call. Miles reads the call from
the model's text (`rollout.multi_turn.tool_format: xml` gives the call `call` with the argument `input`) and hands
it to the environment as the `tool_calls` verifiers expects. Nothing here knows about Miles."""

from __future__ import annotations

import random
import re

import verifiers as vf
from datasets import Dataset

_EXPRESSION = re.compile(r"^(\d{1,6})([+*])(\d{1,6})$")


def call(input: str) -> str:  # noqa: A002 - the argument's name is the tool's (its JSON schema), as the model writes it
    """A calculator: a+b or a*b of non-negative integers, answered as `<value>=`."""
    match = _EXPRESSION.match(input.strip())
    if match is None:
        raise ValueError(f"the calculator reads a+b or a*b, not {input!r:.40}")
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return f"{a + b if op == '+' else a * b}="


def _questions(n: int, op: str, seed: int) -> Dataset:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"question": f"{a}{op}{b}=", "answer": str(a + b if op == "+" else a * b)})
    return Dataset.from_list(rows)


def _text(message) -> str:
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", "")
    return (content or "").strip()


def correct(completion, answer) -> float:
    """1 when the last assistant turn is the product."""
    answers = [_text(m) for m in completion if (m.get("role") if isinstance(m, dict) else m.role) == "assistant"]
    return float(bool(answers) and answers[-1] == answer)


def load_environment(num_train: int = 2000, num_eval: int = 300, op: str = "*", seed: int = 0) -> vf.Environment:
    """One call, then the answer (max_turns 2); the tool monitor adds each tool's call count as a rubric metric.
    `op`: `*` (the model cannot multiply: calling pays) or `+` (it adds, and calls on about half of them)."""
    if op not in ("+", "*"):
        raise ValueError(f"op: {op!r} (+ or *)")
    rubric = vf.Rubric(funcs=[correct], weights=[1.0])
    train, held_out = _questions(num_train, op, seed), _questions(num_eval, op, seed + 1)
    return vf.ToolEnv(tools=[call], max_turns=2, dataset=train, eval_dataset=held_out, rubric=rubric)
