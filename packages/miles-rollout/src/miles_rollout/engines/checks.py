"""What every engine shares: grouping requests by sampling parameters, checks on weight versions."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from miles_rollout.types import GenerateRequest, SamplingParams
from miles_sync import TIED_HEAD


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
        hint = ""
        if TIED_HEAD in unknown and "model.embed_tokens.weight" in expected:
            hint = (
                f" ({TIED_HEAD}: the model ties its head to the embedding, which is published once, as "
                "model.embed_tokens.weight; see miles_sync.without_tied_head)"
            )
        raise ValueError(f"{engine} engine: weight version {weight_version} has unknown weights {unknown[:3]}{hint}")


def check_push(engine: str, handle, published: set[str], expected: set[str], held_version: int) -> None:
    """`check_names` for a push: a whole version must name every parameter; a delta push (`handle.base_version`)
    only known ones, and the engine must hold the version it changes."""
    if handle.base_version is None:
        check_names(engine, handle.weight_version, published, expected)
        return
    if held_version < 0:
        raise ValueError(
            f"{engine} engine: weight version {handle.weight_version} is a delta on version {handle.base_version}, "
            "but the engine's last load failed and its servers may hold part of it: it needs a whole push (the "
            "sender's forget_base())"
        )
    if handle.base_version != held_version:
        raise ValueError(
            f"{engine} engine: weight version {handle.weight_version} is a delta on version {handle.base_version} "
            f"but the engine holds version {held_version}: it needs a whole push (the sender's forget_base())"
        )
    check_names(engine, handle.weight_version, published, published & expected)  # unknown names only


def held_fingerprint(named_tensors: Iterable, held: str, wire: str | None, pieces: dict | None = None) -> str:
    """The fingerprint of `named_tensors` as an engine holding dtype `held` keeps them, taken in the push's wire
    dtype when there is one (a wider engine keeps what it was sent exactly: cast back, it equals the sender's),
    and over the row ranges the push's senders held (`WeightHandle.pieces`) when it had several."""
    import torch

    from miles_sync import weight_fingerprint

    held_dtype = getattr(torch, held)
    as_held = ((name, t.to(held_dtype) if t.is_floating_point() else t) for name, t in named_tensors)
    return weight_fingerprint(as_held, None if wire is None else getattr(torch, wire), pieces)
