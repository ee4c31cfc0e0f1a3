"""SGLang's weight layout for any model, derived from the server itself: no table of families.

Once a server has loaded the checkpoint from disk, its `/weights_checker` checksums are those of its own parameters
as SGLang's loader built them (renamed, fused, stacked, padded). Miles holds the same checkpoint's HF tensors, so it
finds, for every server parameter, the recipe that builds it from them: a tensor as it is (under any name), its
vocabulary rows padded, siblings concatenated (q/k/v, gate/up, whatever a family fuses), or every expert's
projections stacked. The recipes are then applied to each pushed version: the check stays bit-exact, and a family
no one tabled is checked on day 0. A server parameter no recipe reproduces is named in the error, before any step.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from miles_rollout.engines.sglang.layout import sglang_checksum

Build = Callable[[dict[str, torch.Tensor]], torch.Tensor]

PADDINGS = (64, 128, 256, 512)  # vocabulary rows SGLang pads an embedding or head to (its multiple per model)
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<index>\d+)\.(?P<projection>.+)$")


class LayoutError(ValueError):
    """Server parameters whose layout cannot be derived from the checkpoint."""


@dataclass(frozen=True)
class Recipe:
    """How one server parameter is built from HF tensors: `kind` (copy, pad, cat, stack), its sources, an argument."""

    kind: str
    sources: tuple[str, ...]
    arg: object = None

    def build(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.kind == "copy":
            return tensors[self.sources[0]]
        if self.kind == "pad":
            return _pad(tensors[self.sources[0]], int(self.arg))  # type: ignore[call-overload]
        if self.kind == "cat":
            return torch.cat([tensors[s] for s in self.sources], dim=0)
        assert self.kind == "stack"  # arg: the number of sources per expert, concatenated along dim 0 each
        per = int(self.arg)  # type: ignore[call-overload]
        groups = [self.sources[i : i + per] for i in range(0, len(self.sources), per)]
        return torch.stack([torch.cat([tensors[s] for s in group], dim=0) for group in groups])


def _pad(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    rows = -(-tensor.shape[0] // multiple) * multiple
    return torch.cat([tensor, tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))])


def _shared(a: str, b: str) -> tuple[int, int]:
    """How alike two names are: the common prefix's length, then the common suffix's."""
    return len(os.path.commonprefix([a, b])), len(os.path.commonprefix([a[::-1], b[::-1]]))


def derive_layout(hf: dict[str, torch.Tensor], server: dict[str, str]) -> dict[str, Recipe]:
    """For each server parameter (name → checksum, what `/weights_checker` reports after loading the checkpoint
    whose tensors `hf` holds, cast to the engine's dtype), the recipe that gives its checksum; LayoutError naming
    those none gives."""
    sums = {name: sglang_checksum(t) for name, t in hf.items()}
    by_sum: dict[str, list[str]] = {}
    for name, checksum in sums.items():
        by_sum.setdefault(checksum, []).append(name)
    recipes: dict[str, Recipe] = {}
    for internal, checksum in server.items():
        if sums.get(internal) == checksum:
            recipes[internal] = Recipe("copy", (internal,))
        elif checksum in by_sum:  # renamed (or a tied head): the most alike name among equal contents
            source = max(by_sum[checksum], key=lambda name: _shared(name, internal))
            recipes[internal] = Recipe("copy", (source,))
    # weights first: a bias fused like its weight takes the weight's order (zero biases match in any order)
    for internal in sorted(server, key=lambda n: not n.endswith(".weight")):
        if internal not in recipes and (recipe := _composed(internal, server[internal], hf, recipes)) is not None:
            recipes[internal] = recipe
    missing = sorted(set(server) - set(recipes))
    if missing:
        raise LayoutError(
            f"{len(missing)} of the server's {len(server)} parameters are built from the checkpoint in a way miles "
            f"cannot reproduce (not a tensor as it is, padded, concatenated or stacked), e.g. {missing[:3]}"
        )
    return recipes


def _composed(internal: str, checksum: str, hf: dict[str, torch.Tensor], found: dict[str, Recipe]) -> Recipe | None:
    """A padded, concatenated or stacked recipe whose checksum is `checksum`, or None."""
    parent, _, leaf = internal.rpartition(".")
    module = parent.rpartition(".")[0]
    weight = found.get(f"{parent}.weight")
    if leaf != "weight" and weight is not None and weight.kind == "cat":  # the weight's order, for this leaf
        same = tuple(f"{source.rpartition('.')[0]}.{leaf}" for source in weight.sources)
        if all(s in hf for s in same) and sglang_checksum(torch.cat([hf[s] for s in same])) == checksum:
            return Recipe("cat", same)
    if internal in hf:  # the same name, another content: padded rows
        for multiple in PADDINGS:
            if hf[internal].shape[0] % multiple and sglang_checksum(_pad(hf[internal], multiple)) == checksum:
                return Recipe("pad", (internal,), multiple)
    # siblings fused along dim 0: `<module>.<x>.<leaf>` for the server's `<module>.<fused>.<leaf>`
    siblings = sorted(
        n for n in hf if n.rpartition(".")[2] == leaf and n.rpartition(".")[0].rpartition(".")[0] == module
    )
    for size in (2, 3):
        for combo in itertools.permutations(siblings, size):
            if (
                len({hf[s].shape[1:] for s in combo}) == 1
                and sglang_checksum(torch.cat([hf[s] for s in combo])) == checksum
            ):
                return Recipe("cat", combo)
    return _stacked(internal, checksum, hf)


def _stacked(internal: str, checksum: str, hf: dict[str, torch.Tensor]) -> Recipe | None:
    """Every expert's projection (or two, concatenated) stacked: `<...>.experts.w13_weight` from
    `<...>.experts.<j>.gate_proj.weight` and `up_proj`, whatever the names."""
    if ".experts." not in internal:
        return None
    prefix = internal[: internal.index(".experts.") + len(".experts")]
    experts: dict[int, dict[str, str]] = {}
    for name in hf:
        match = _EXPERT.match(name)
        if match and match["prefix"] == prefix:
            experts.setdefault(int(match["index"]), {})[match["projection"]] = name
    if not experts or sorted(experts) != list(range(len(experts))):
        return None
    projections = sorted(set.intersection(*(set(p) for p in experts.values())))
    for size in (1, 2):
        for combo in itertools.permutations(projections, size):
            sources = tuple(experts[j][p] for j in sorted(experts) for p in combo)
            recipe = Recipe("stack", sources, size)
            try:
                built = recipe.build(hf)
            except RuntimeError:  # shapes that do not concatenate or stack
                continue
            if sglang_checksum(built) == checksum:
                return recipe
    return None


def expected_by_recipes(recipes: dict[str, Recipe], tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The checksums the server reports once it holds `tensors` (HF names, in the engine's dtype)."""
    return {internal: sglang_checksum(recipe.build(tensors)) for internal, recipe in recipes.items()}


def in_dtype(tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF tensors as the servers hold them: floating point ones in the engine's dtype."""
    return {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors}
