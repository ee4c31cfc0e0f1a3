"""Reward functions: a registry of named ones, plus any function reachable by dotted path.

A reward function takes a `Sample` (with `response_text` and `label` filled in) and returns a
float.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

from miles_rollout.plugins import resolve_dotted
from miles_rollout.types import Sample

RewardFn = Callable[[Sample], float]

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
    value = reward_fn(sample)
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


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


def resolve_reward(name_or_path: str) -> RewardFn:
    """A registered name, else a dotted path; the result must be callable."""
    if name_or_path in _REGISTRY:
        return _REGISTRY[name_or_path]
    if "." not in name_or_path and ":" not in name_or_path:
        raise ValueError(
            f"unknown reward {name_or_path!r}: registered are {registered_rewards()}, "
            "or give a dotted path 'package.module:function'"
        )
    fn = resolve_dotted(name_or_path)
    if not callable(fn):
        raise ValueError(f"reward {name_or_path!r} resolves to a {type(fn).__name__}, not a function")
    return fn


@register_reward("exact_match")
def exact_match(sample: Sample) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the label exactly."""
    return float(sample.response_text.strip() == sample.label.strip())
