"""A weight fingerprint: equal fingerprints mean bit-identical tensors under identical names."""

from __future__ import annotations

import hashlib

import torch

from miles_sync.types import NamedTensors


class Fingerprinter:
    """Incremental fingerprint, so a sender can hash buckets as they stream past.

    Order-independent across tensors (each tensor is hashed alone and the per-tensor digests are
    combined sorted by name), so a receiver that holds the weights in another order agrees.
    """

    def __init__(self) -> None:
        self._digests: dict[str, bytes] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        h = hashlib.blake2b(digest_size=16)
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(tensor.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
        self._digests[name] = h.digest()

    def hexdigest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for name in sorted(self._digests):
            h.update(self._digests[name])
        return h.hexdigest()


def weight_fingerprint(named_tensors: NamedTensors, dtype: torch.dtype | None = None) -> str:
    """Fingerprint of `named_tensors`, optionally after casting floating tensors to `dtype`."""
    fp = Fingerprinter()
    for name, tensor in named_tensors:
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        fp.add(name, tensor)
    return fp.hexdigest()
