"""Checks every engine applies to a published weight version before loading it."""

from __future__ import annotations


def check_names(engine: str, weight_version: int, published: set[str], expected: set[str]) -> None:
    """Refuse a weight version that lacks or adds tensors, naming a few of them."""
    missing, unknown = sorted(expected - published), sorted(published - expected)
    if missing:
        raise ValueError(
            f"{engine} engine: weight version {weight_version} lacks {len(missing)} parameter(s), e.g. {missing[:3]}"
        )
    if unknown:
        raise ValueError(f"{engine} engine: weight version {weight_version} has unknown weights {unknown[:3]}")
