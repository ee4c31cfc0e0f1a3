"""A weight fingerprint: equal fingerprints mean bit-identical tensors under identical names.

Each tensor is hashed with XXH3-128 over its bytes in place (a view of the tensor's memory, no copy): about
7.6 GB/s on this machine's one core against blake2b's 0.5 GB/s with the copy it used to make (500 MB: 0.066 s
against 1.46 s), faster than a memory copy of the same bytes. XXH3 is not cryptographic: the fingerprint
detects a transport that corrupts, drops or reorders weights, not a party forging them.
"""

from __future__ import annotations

import torch
import xxhash

from miles_sync.types import NamedTensors


class Fingerprinter:
    """Incremental fingerprint, so a sender can hash buckets as they stream past.

    Order-independent across tensors (each tensor is hashed alone and the per-tensor digests are
    combined sorted by name), so a receiver that holds the weights in another order agrees.
    """

    def __init__(self) -> None:
        self._digests: dict[str, bytes] = {}

    def add(self, name: str, tensor: torch.Tensor) -> bytes:
        """Hash one tensor under its name; returns its digest (what a delta push compares)."""
        t = tensor.detach().to("cpu").contiguous().reshape(-1)  # no copy for a contiguous CPU tensor
        h = xxhash.xxh3_128()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(tensor.shape)).encode())
        h.update(memoryview(t.view(torch.uint8).numpy()))
        self._digests[name] = digest = h.digest()
        return digest

    @property
    def digests(self) -> dict[str, bytes]:
        return dict(self._digests)

    @classmethod
    def of_digests(cls, digests: dict[str, bytes]) -> Fingerprinter:
        """A fingerprinter holding digests computed elsewhere (other sender ranks' pieces)."""
        fp = cls()
        fp._digests.update(digests)
        return fp

    def hexdigest(self) -> str:
        h = xxhash.xxh3_128()
        for name in sorted(self._digests):
            h.update(self._digests[name])
        return h.hexdigest()


Pieces = dict[str, list[tuple[int, int]]]
"""Per tensor name, the row ranges `[start, stop)` of dimension 0 hashed separately (see `piece_name`)."""


def piece_name(name: str, start: int, stop: int) -> str:
    """The name rows `start:stop` of a tensor are hashed under when they are a piece of it."""
    return f"{name}[{start}:{stop}]"


def weight_fingerprint(
    named_tensors: NamedTensors, dtype: torch.dtype | None = None, pieces: Pieces | None = None
) -> str:
    """Fingerprint of `named_tensors`, optionally after casting floating tensors to `dtype`.

    `pieces` (a push whose senders each held row ranges of a tensor, `WeightHandle.pieces`): those tensors are
    hashed as the listed row ranges, each under `piece_name`, as their senders hashed them; equal fingerprints
    still mean bit-identical tensors, since the ranges cover every row."""
    fp = Fingerprinter()
    for name, tensor in named_tensors:
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        ranges = pieces.get(name) if pieces else None
        if ranges is None:
            fp.add(name, tensor)
            continue
        covered = sorted(ranges)
        if (
            covered[0][0] != 0
            or covered[-1][1] != tensor.shape[0]
            or any(a[1] != b[0] for a, b in zip(covered, covered[1:], strict=False))
        ):
            raise ValueError(f"{name}: pieces {ranges} do not cover its {tensor.shape[0]} rows once")
        for start, stop in covered:
            fp.add(piece_name(name, start, stop), tensor[start:stop])
    return fp.hexdigest()
