"""What every engine shares: grouping requests by sampling parameters, checks on weight versions."""

from __future__ import annotations

from collections import defaultdict

from miles_rollout.types import GenerateRequest, SamplingParams


def group_by_sampling(requests: list[GenerateRequest]) -> dict[SamplingParams, list[int]]:
    """Indices of `requests` per distinct sampling parameters (one batched call each)."""
    groups: dict[SamplingParams, list[int]] = defaultdict(list)
    for index, request in enumerate(requests):
        groups[request.sampling].append(index)
    return groups


def check_names(engine: str, weight_version: int, published: set[str], expected: set[str]) -> None:
    """Refuse a weight version that lacks or adds tensors, naming a few of them."""
    missing, unknown = sorted(expected - published), sorted(published - expected)
    if missing:
        raise ValueError(
            f"{engine} engine: weight version {weight_version} lacks {len(missing)} parameter(s), e.g. {missing[:3]}"
        )
    if unknown:
        raise ValueError(f"{engine} engine: weight version {weight_version} has unknown weights {unknown[:3]}")
