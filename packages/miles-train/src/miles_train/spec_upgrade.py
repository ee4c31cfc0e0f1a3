"""Specs written by earlier versions of Miles, read as today's: a stored job keeps loading after a rename.

Each upgrade is a pure function of the `train` mapping; `TrainConfig` runs them before it validates. An upgrade that
moves a setting warns (FutureWarning) so that the spec's author writes it in the new place; one that would have to
choose between two values refuses, naming both fields.
"""

from __future__ import annotations

import warnings
from typing import Any


def upgrade_train_spec(data: Any) -> Any:
    """`data` (the `train` mapping) with every earlier layout read as today's; anything else as it is."""
    if not isinstance(data, dict):
        return data
    data = _grpo_section(data)
    data = _mixed_precision(data)
    if isinstance(data.get("algorithm"), dict):
        data = data | {"algorithm": _staleness_max(data["algorithm"])}
    return data


def _grpo_section(data: dict[str, Any]) -> dict[str, Any]:
    """Before the one `train.algorithm` section, the loss settings every algorithm shares sat in `train.grpo`: move
    them into `train.algorithm`. A field set in both places with different values is refused, naming it.
    `loss_aggregation`, which had one allowed value, is dropped (the aggregation is algorithm.aggregation)."""
    if "grpo" not in data:
        return data
    data = dict(data)
    old = data.pop("grpo") or {}
    if not isinstance(old, dict):
        raise ValueError(f"grpo: expected a mapping of the shared loss settings, got {type(old).__name__}")
    algorithm = data.get("algorithm") or {}
    algorithm = {"name": algorithm} if isinstance(algorithm, str) else dict(algorithm)
    moved = [key for key in old if key != "loss_aggregation"]
    for key in moved:
        if key in algorithm and algorithm[key] != old[key]:
            raise ValueError(
                f"grpo.{key} ({old[key]!r}) and algorithm.{key} ({algorithm[key]!r}) disagree: train.grpo is the "
                "old place of the same setting; keep only train.algorithm"
            )
        algorithm[key] = old[key]
    if moved:
        warnings.warn(
            "train.grpo is deprecated: its settings belong in train.algorithm ("
            + ", ".join(f"grpo.{key} → algorithm.{key}" for key in moved)
            + "); this spec still loads",
            FutureWarning,
            stacklevel=4,
        )
    data["algorithm"] = algorithm
    return data


def _mixed_precision(data: dict[str, Any]) -> dict[str, Any]:
    """Before `train.precision`, fsdp2's `backend.mixed_precision` said bf16: read it as the precision."""
    backend = data.get("backend")
    if not (isinstance(backend, dict) and "mixed_precision" in backend):
        return data
    backend = dict(backend)
    old = backend.pop("mixed_precision")
    data = dict(data) | {"backend": backend}
    if old == "bf16":
        data.setdefault("precision", "bf16")
    return data


def _staleness_max(algorithm: dict[str, Any]) -> dict[str, Any]:
    """`staleness_max` was the first name of `drop_older_than`."""
    if "staleness_max" in algorithm and "drop_older_than" not in algorithm:
        rest = {k: v for k, v in algorithm.items() if k != "staleness_max"}
        return rest | {"drop_older_than": algorithm["staleness_max"]}
    return algorithm
