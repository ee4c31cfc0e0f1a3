"""A tool-use task: multiplication beyond the built-in model's reach, with a calculator it can call.

`"37*58="` → the model either answers at once (`"2146"`: a 1 M-parameter model does not multiply) or calls the
calculator: `"<call>37*58</call>"` → the tool answers `"2146="` → the model writes the answer. Reward 1 for a
right final answer, 0 otherwise; a call the calculator cannot read ends the episode with reward 0. The call
tokens `<call>` and `</call>` are single tokens of the built-in calculator model (`model.name:
tiny-qwen2-calculator`), whose warm start demonstrates calls on a small share of its examples
(`calculator_demonstrations`): RL has to learn when calling pays.

    rollout:
      generate: multi_turn
      environment: miles_rollout.tasks.calculator:Calculator
      multi_turn: {tool_format: xml}
      reward: env
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

from miles_rollout.env import Action, StepResult
from miles_rollout.types import PromptRecord

CALL_TOKENS = ("<call>", "</call>")
_EXPRESSION = re.compile(r"^(\d{1,6})([+\-*])(\d{1,6})$")
_OPS: dict[str, Callable[[int, int], int]] = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def calculate(expression: str) -> int:
    """The value of `a+b`, `a-b` or `a*b` (non-negative integers of at most 6 digits); ValueError for anything
    else (nothing is evaluated as Python)."""
    match = _EXPRESSION.match(expression.strip())
    if match is None:
        raise ValueError(f"the calculator reads a+b, a-b or a*b, not {expression!r:.40}")
    a, op, b = match.groups()
    return _OPS[op](int(a), int(b))


class Calculator:
    """One episode of the calculator task (a new one per episode). `max_calls` calls, then an answer."""

    tools = [
        {
            "type": "function",
            "function": {
                "name": "call",
                "description": "A calculator: a+b, a-b or a*b of non-negative integers.",
                "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]},
            },
        }
    ]

    def __init__(self, max_calls: int = 1) -> None:
        if max_calls < 0:
            raise ValueError(f"max_calls: {max_calls} (at least 0)")
        self.max_calls = max_calls
        self.record: PromptRecord | None = None
        self.calls = 0

    def reset(self, record: PromptRecord) -> None:
        self.record, self.calls = record, 0
        return None  # the prompt is the first observation

    def step(self, action: Action) -> StepResult:
        assert self.record is not None, "step() before reset()"
        if action.tool_call is None:  # the answer
            right = action.text.strip() == self.record.label.strip()
            return StepResult(reward=1.0 if right else 0.0, done=True)
        self.calls += 1
        if action.tool_call.name != "call":  # the xml format's name; with hermes the model names the tool
            return StepResult(reward=0.0, done=True, info={"error": f"no tool {action.tool_call.name!r}: 'call'"})
        if self.calls > self.max_calls:
            return StepResult(reward=0.0, done=True, info={"error": f"more than {self.max_calls} calls"})
        try:
            value = calculate(str(action.tool_call.arguments.get("input", "")))
        except ValueError as exc:
            return StepResult(reward=0.0, done=True, info={"error": str(exc)})
        return StepResult(observation=f"{value}=")


def calculator_demonstrations(
    records: list[PromptRecord],
    encode: Callable[[str], list[int]],
    eos_id: int,
    call_share: dict[str, float],
    seed: int,
) -> list[tuple[list[int], list[int], list[int]]]:
    """Warm-start examples `(prompt ids, completion ids, mask)`: `call_share[op]` of the prompts with operator
    `op` call the calculator (`<call>a*b</call><eos>` trained, the tool's `value=` context only, then the answer
    trained), the others answer at once. The ids are those an episode of `Calculator` has, token for token."""
    rng = random.Random(seed)
    examples = []
    for record in records:
        prompt = encode(record.prompt)
        answer = encode(record.label) + [eos_id]
        match = _EXPRESSION.match(record.prompt.rstrip("="))
        if match is None:
            raise ValueError(f"calculator_demonstrations: {record.prompt!r} is not a+b=, a-b= or a*b=")
        if rng.random() < call_share.get(match.group(2), 0.0):
            call = encode(f"{CALL_TOKENS[0]}{record.prompt.rstrip('=')}{CALL_TOKENS[1]}") + [eos_id]
            tool = encode(f"{calculate(record.prompt.rstrip('='))}=")
            examples.append((prompt, call + tool + answer, [1] * len(call) + [0] * len(tool) + [1] * len(answer)))
        else:
            examples.append((prompt, answer, [1] * len(answer)))
    return examples


def tool_use_records(records: list[PromptRecord], eos_token: str) -> list[PromptRecord]:
    """The same prompts with the call made and the tool's answer shown: what the model must copy (the warm
    start's held-out check)."""
    out = []
    for r in records:
        expression = r.prompt.rstrip("=")
        prompt = f"{r.prompt}{CALL_TOKENS[0]}{expression}{CALL_TOKENS[1]}{eos_token}{calculate(expression)}="
        out.append(PromptRecord(prompt, r.label))
    return out
