"""`rollout.reward: code`: model-written Python run against tests in the sandbox (`miles_rollout.sandbox`).

A prompt record carries its tests in `metadata["tests"]` (or as JSON in its label), in the two shapes public coding
sets use:

    {"stdin_stdout": [{"input": "2 3\\n", "output": "5\\n"}, ...]}     each case: the program's output for that input
    {"asserts": ["assert add(2, 3) == 5", ...]}                         each line run after the program's code

The program is the response's last fenced code block (```python … ```), or the whole response when it has none.
The reward is the share of the cases passed (`rollout.code_sandbox.score: fraction`), or 1 only when all pass
(`all`). Every execution's outcome (`sandbox.Outcome`) is kept in `metadata["code"]`, and each step reports the
share of each outcome as `reward/code_<outcome>`.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from miles_rollout.config import CodeSandboxConfig
from miles_rollout.rewards import RewardError
from miles_rollout.sandbox import Limits, Outcome, Sandbox
from miles_rollout.types import Sample

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def program_of(response: str) -> str:
    """The code a response gives: its last fenced block, else all of it."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def cases_of(sample: Sample) -> dict[str, Any]:
    """The sample's tests, checked: one of the two shapes, with at least one case."""
    tests = sample.metadata.get("tests")
    if tests is None:
        try:
            tests = json.loads(sample.label)
        except ValueError:
            raise RewardError(
                "reward 'code': the prompt record has no tests (metadata.tests, or JSON tests as its label)"
            ) from None
    if isinstance(tests, dict) and isinstance(tests.get("stdin_stdout"), list) and tests["stdin_stdout"]:
        for i, case in enumerate(tests["stdin_stdout"]):
            if not isinstance(case, dict) or not isinstance(case.get("output"), str):
                raise RewardError(f"reward 'code': tests.stdin_stdout[{i}] needs an output (and an input) string")
        return tests
    if isinstance(tests, dict) and isinstance(tests.get("asserts"), list) and tests["asserts"]:
        if not all(isinstance(line, str) for line in tests["asserts"]):
            raise RewardError("reward 'code': tests.asserts must be a list of strings")
        return tests
    raise RewardError("reward 'code': tests must be {stdin_stdout: [{input, output}, ...]} or {asserts: [...]}")


class CodeReward:
    """A batched, async reward function over a pool of sandboxed executions (started on first use)."""

    batched = True

    def __init__(self, config: CodeSandboxConfig) -> None:
        self.config = config
        self._sandbox: Sandbox | None = None

    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            c = self.config
            limits = Limits(c.cpu_s, c.wall_s, c.memory_mb, c.processes, c.output_bytes, c.file_mb)
            self._sandbox = Sandbox(c.tool, limits, c.python, c.workers, c.queue)
        return self._sandbox

    async def __call__(self, samples: list[Sample]) -> list[float]:
        return list(await asyncio.gather(*[self._one(sample) for sample in samples]))

    async def _one(self, sample: Sample) -> float:
        tests = cases_of(sample)
        program = program_of(sample.response_text)
        box = self.sandbox()
        if "stdin_stdout" in tests:
            futures = [box.submit(program, case.get("input", ""), case["output"]) for case in tests["stdin_stdout"]]
        else:
            futures = [box.submit(program + "\n\n" + line + "\n") for line in tests["asserts"]]
        runs = await asyncio.gather(*[asyncio.wrap_future(f) for f in futures])
        outcomes = [run.outcome.value for run in runs]
        passed = sum(o == Outcome.PASSED.value for o in outcomes)
        sample.metadata["code"] = {"outcomes": outcomes, "reasons": [run.reason for run in runs][:4]}
        if self.config.score == "all":
            return float(passed == len(runs))
        return passed / len(runs)


def code_metrics(samples: list[Sample]) -> dict[str, float]:
    """The share of each outcome among a step's executions (`reward/code_<outcome>`); none without code rewards."""
    outcomes = [o for s in samples if isinstance(s.metadata.get("code"), dict) for o in s.metadata["code"]["outcomes"]]
    if not outcomes:
        return {}
    return {f"reward/code_{o.value}": outcomes.count(o.value) / len(outcomes) for o in Outcome}
