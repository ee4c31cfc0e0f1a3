"""Reward functions: a registry of named ones, plus any function reachable by dotted path.

A reward function takes a `Sample` (with `response_text` and `label` filled in) and returns a
float, or is `async` and returns one when awaited (the samples of a step are then scored concurrently).
A function marked `@batched` takes the step's list of samples and returns a list of floats, one each (a
reward model, a remote verifier). An episode's transcript is in `sample.metadata["episode"]`.

Built in: `exact_match`, `env` (an episode's environment rewards), `math_verify` (the answer is
mathematically equal to the label: PyPI math-verify), `remote` (an HTTP service, `rollout.remote_reward`), `code`
(programs run against tests in a sandbox, `rollout.code_sandbox`) and `judge` (a judge model, `rollout.judge`).
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import inspect
import math
import numbers
import threading
from collections.abc import Callable
from typing import Any

from miles_rollout.plugin_check import resolve_named
from miles_rollout.types import Sample

RewardFn = Callable[[Sample], Any]


def batched(fn: Callable) -> Callable:
    """Mark a reward function that scores a whole step at once: `fn(samples) -> list[float]` (or async)."""
    fn.batched = True  # type: ignore[attr-defined]
    return fn


_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def decorate(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return decorate


class RewardError(ValueError):
    """A reward function that returned something other than a finite number; names the function and the value."""


def score(reward_fn: RewardFn, sample: Sample, name: str) -> float:
    """`reward_fn(sample)` as a float; a non-number (or NaN, inf) raises RewardError naming `name` and the value."""
    return as_reward(reward_fn(sample), sample, name)


def as_reward(value: Any, sample: Sample, name: str) -> float:
    """`value` (a reward function's answer for `sample`) as a float, or RewardError naming `name` and the value."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d tensor or array (a reward model's)
        value = value.item()
    if isinstance(value, numbers.Real) and math.isfinite(value):  # bool and NumPy scalars are numbers too
        return float(value)
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise RewardError(
        f"reward {name!r} returned {shown} ({type(value).__name__}) for the response {sample.response_text[:60]!r} "
        f"to {sample.prompt[:60]!r}: a reward must be a finite number"
    )


async def score_all(reward_fn: RewardFn, samples: list[Sample], name: str) -> list[float]:
    """Every sample's reward: one call of a `@batched` function, else one call per sample (awaited together
    when the function is async)."""
    if getattr(reward_fn, "batched", False):
        values = reward_fn(samples)
        if inspect.isawaitable(values):
            values = await values
        if not isinstance(values, list | tuple) or len(values) != len(samples):
            size = len(values) if isinstance(values, list | tuple) else type(values).__name__
            raise RewardError(f"reward {name!r} (batched) returned {size} rewards for {len(samples)} samples")
        return [as_reward(v, s, name) for v, s in zip(values, samples, strict=True)]
    if _is_async(reward_fn):
        values = await asyncio.gather(*[reward_fn(s) for s in samples])
        return [as_reward(v, s, name) for v, s in zip(values, samples, strict=True)]
    return [score(reward_fn, s, name) for s in samples]


def _is_async(fn: Any) -> bool:
    """An `async def` function, or an object whose `__call__` is one (a reward model client's instance)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def probe_reward(reward_fn: RewardFn, name: str, record: Any, call: bool = True) -> None:
    """Before any engine starts: `reward_fn` takes what Miles passes it (one Sample, or a list for `@batched`), and,
    with `call`, scores a sample made of `record` (a PromptRecord; its label as the response) with a finite number.
    Raises ValueError naming what is wrong; the caller names the spec's field."""
    is_batched = getattr(reward_fn, "batched", False)
    sample = Sample(
        group_index=0, prompt=record.prompt, label=record.label, prompt_ids=[], response_ids=[], rollout_logprobs=[],
        loss_mask=[], response_text=record.label, metadata=dict(record.metadata), weight_versions=[0],
    )  # fmt: skip
    argument: Any = [sample] if is_batched else sample
    try:
        signature = inspect.signature(reward_fn)
    except (TypeError, ValueError):  # a builtin or extension callable: nothing to read, the call below tells
        signature = None
    if signature is not None:
        try:
            signature.bind(argument)
        except TypeError as exc:
            takes = "a list of Samples (it is @batched)" if is_batched else "one Sample (.response_text, .label, ...)"
            raise ValueError(f"{name} has the signature {signature}; a reward takes {takes}: {exc}") from None
    if not call:
        return
    try:
        values = reward_fn(argument)
        if inspect.isawaitable(values):
            values = asyncio.run(_awaited(values))
    except Exception as exc:  # noqa: BLE001 - the user's code: reported with the field, before anything started
        raise ValueError(
            f"{name} raised {type(exc).__name__}: {exc} when called on the first prompt ({record.prompt[:60]!r}) "
            f"with its label as the response"
        ) from None
    if is_batched:
        if not isinstance(values, list | tuple) or len(values) != 1:
            raise ValueError(f"{name} (@batched) returned {type(values).__name__} for 1 sample; it returns a list")
        values = values[0]
    try:
        as_reward(values, sample, name)
    except RewardError as exc:
        raise ValueError(str(exc)) from None


async def _awaited(value: Any) -> Any:
    return await value


def registered_rewards() -> list[str]:
    return sorted([*_REGISTRY, "remote", "code", "judge"])


def resolve_reward(name_or_path: str, remote: Any = None, code_sandbox: Any = None, judge: Any = None) -> RewardFn:
    """A registered name, else a dotted path; the result must be callable. `remote`: `rollout.remote_reward`
    (the `remote` reward's service); `code_sandbox`: `rollout.code_sandbox` (the `code` reward's sandbox); `judge`:
    `rollout.judge` (the `judge` reward's model)."""
    if name_or_path == "judge":
        if judge is None:
            raise ValueError("reward 'judge' needs rollout.judge (its model and template)")
        from miles_rollout.judge import JudgeReward

        return JudgeReward(judge)
    if name_or_path == "code":
        from miles_rollout.code_reward import CodeReward
        from miles_rollout.config import CodeSandboxConfig

        return CodeReward(code_sandbox if code_sandbox is not None else CodeSandboxConfig())
    if name_or_path == "remote":
        if remote is None:
            raise ValueError("reward 'remote' needs rollout.remote_reward (the service's url)")
        from miles_rollout.remote_reward import RemoteReward

        return RemoteReward(remote)
    if name_or_path == "math_verify" and importlib.util.find_spec("math_verify") is None:
        raise ValueError("reward 'math_verify' needs PyPI math-verify: pip install 'miles-rollout[math]'")
    fn = resolve_named(
        name_or_path, _REGISTRY, f"unknown reward {name_or_path!r}: registered are {registered_rewards()}"
    )
    if not callable(fn):
        raise ValueError(f"reward {name_or_path!r} resolves to a {type(fn).__name__}, not a function")
    return fn


@register_reward("exact_match")
def exact_match(sample: Sample) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the label exactly."""
    return float(sample.response_text.strip() == sample.label.strip())


@register_reward("env")
def env_reward(sample: Sample) -> float:
    """The environment's rewards of a multi-turn episode, summed (`metadata["episode"]["env_reward"]`)."""
    episode = sample.metadata.get("episode")
    if not isinstance(episode, dict):
        raise RewardError("reward 'env' scores episodes: set rollout.generate: multi_turn and rollout.environment")
    return float(episode["env_reward"])


_MATH_VERIFIER: Any = None  # one worker process per rollout process, started on first use
_MATH_VERIFIER_LOCK = threading.Lock()


@register_reward("math_verify")
def math_verify(sample: Sample) -> float:
    """1.0 when the response's answer is mathematically equal to the label (PyPI math-verify: LaTeX or plain
    expressions, `\\boxed{}` preferred, `\\frac12` equals `0.5`), else 0.0. Checked in a worker process
    (`miles_rollout.math_worker`), where math-verify's own time limits work from any thread, with a hard limit of
    60 s a check besides: an answer it cannot decide in time, or whose check kills the worker, scores 0."""
    global _MATH_VERIFIER
    from miles_rollout.math_worker import LabelError, MathVerifier

    with _MATH_VERIFIER_LOCK:
        if _MATH_VERIFIER is None:
            _MATH_VERIFIER = MathVerifier()
            atexit.register(_MATH_VERIFIER.close)  # a worker stuck in C would outlive an idle parent's EOF
    try:
        return _MATH_VERIFIER.check(sample.label, sample.response_text)
    except LabelError as exc:
        raise RewardError(f"reward 'math_verify': {exc}") from None
