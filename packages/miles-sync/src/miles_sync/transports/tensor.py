"""tensor: buckets in shared memory, handed over as serialized tensor handles (no copy of the data).

Each bucket is copied once into a flat buffer in shared memory and serialized (`miles_sync.shared`): the handle
carries these short strings, and any process on the same machine rebuilds the tensors from them without copying
the bytes (CUDA IPC handles for CUDA tensors). The buffers are a ring of `keep_versions` slots, reused version
after version: a push writes into memory whose pages are already mapped (a fresh /dev/shm file costs a page
fault per 4 KiB on first touch, 1.5–3× the copy itself on this machine), and the last `keep_versions` versions
stay readable (a publish overwrites the oldest one's slot as it goes). Each buffer starts with the version it
holds, so a payload unpickled after its slot was reused fails naming both versions instead of handing over another
version's bytes; tensors mapped before the reuse see the new bytes (a receiver copies what it keeps, as every
engine does). Every pickling pins a /dev/shm file that
only an unpickling releases, so `close()` drops the buffers and unlinks the files that unread payloads still pin.
A handle's payload is meant to be read once per process: a receiver that hands tensors on (an engine feeding
several servers) re-serializes its own mapped tensors, one payload per reader.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from miles_sync.config import TensorSync
from miles_sync.protocol import LoadsTensors
from miles_sync.shared import (
    deserialize_bucket,
    new_shared,
    release_files,
    serialize_bucket,
    shm_file,
    use_file_system_sharing,
)
from miles_sync.transports.base import BucketedSender
from miles_sync.types import NamedTensor, TensorHandle

NAME = "tensor"
ALIGN = 64  # every tensor starts at a multiple of this in its bucket's buffer (any element size divides it)
STAMP = "\x00stamp"
"""The first entry of every payload is named `STAMP <version> <publish number>` (not a weight's name) and maps the
buffer's first 16 bytes, where the sender wrote the same two numbers: they differ once the buffer was reused."""


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def _file_alive(buffer: torch.Tensor) -> bool:
    """Whether a buffer's /dev/shm file is still there to be mapped. A payload unpickled more often than it was
    pickled (two processes reading one, as SGLang's data-parallel replicas do with a server's payload) drives
    torch's reference count in the file to zero early and a reader unlinks it: the buffer is then replaced (the
    old mapping stays valid for whoever holds it)."""
    name = shm_file(buffer)
    return name is None or os.path.exists(os.path.join("/dev/shm", name.lstrip("/")))


class TensorSender(BucketedSender):
    name = NAME

    def __init__(self, config: TensorSync, receiver_ranks: int = 1) -> None:
        super().__init__(config, receiver_ranks)
        use_file_system_sharing()
        self._ring: list[list[torch.Tensor]] = [[] for _ in range(config.keep_versions)]  # per slot, per bucket
        self._published = 0

    def _begin(self, weight_version: int) -> None:
        self._slot = self._ring[self._published % len(self._ring)]  # the oldest kept version's: reused
        self._version = weight_version
        self._payloads: list[str] = []

    def _put_bucket(self, index: int, bucket: list[NamedTensor]) -> None:
        # A private copy in shared memory: the published version stays immutable while training goes on.
        size = ALIGN + sum(_aligned(t.numel() * t.element_size()) for _, t in bucket)
        if index < len(self._slot) and self._slot[index].numel() >= size and _file_alive(self._slot[index]):
            buffer = self._slot[index]
        else:
            buffer = new_shared(size, torch.device("cuda") if bucket[0][1].is_cuda else torch.device("cpu"))
            replaced = self._slot[index:index + 1]  # fmt: skip
            self._slot[index:index + 1] = [buffer]  # fmt: skip
            self._drop(replaced)
        stamp = buffer[:16].view(torch.int64)
        stamp[0], stamp[1] = self._version, self._published
        shared: list[NamedTensor] = [(f"{STAMP} {self._version} {self._published}", stamp)]
        offset = ALIGN
        for name, tensor in bucket:
            nbytes = tensor.numel() * tensor.element_size()
            view = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            shared.append((name, view))
            offset += _aligned(nbytes)
        self._payloads.append(serialize_bucket(shared))

    def _finish(self, common: dict) -> TensorHandle:
        past = self._slot[common["num_buckets"] :]  # a smaller version: buckets past its last are not kept
        del self._slot[common["num_buckets"] :]
        self._drop(past)
        self._published += 1
        return TensorHandle(**common, payloads=self._payloads)

    def _drop(self, buffers: list[torch.Tensor]) -> None:
        """Free buffers taken out of the ring (their version is released; `buffers` holds the last reference),
        with the files unread payloads pin."""
        files = [f for b in buffers if (f := shm_file(b))]
        release_files([buffers], files)

    def close(self) -> None:
        files = [f for slot in self._ring for b in slot if (f := shm_file(b))]
        keep = len(self._ring)
        release_files(self._ring, files)  # empties every slot in place (`_slot` too), then the ring
        self._ring = [[] for _ in range(keep)]


Sender = TensorSender


def read(handle: TensorHandle) -> Iterator[list[NamedTensor]]:
    """The buckets, mapped from the sender's shared memory (no copy)."""
    for payload in handle.payloads:
        try:
            bucket = deserialize_bucket(payload)
        except (FileNotFoundError, RuntimeError) as exc:
            raise FileNotFoundError(
                f"weight version {handle.weight_version}: its shared memory is gone (released by the sender, "
                f"or another machine): {exc}"
            ) from None
        (stamp, held), *tensors = bucket
        if not stamp.startswith(STAMP) or stamp.split()[1:] != [str(int(v)) for v in held.tolist()]:
            raise FileNotFoundError(
                f"weight version {handle.weight_version}: its shared memory now holds version {int(held[0])} (the "
                "sender keeps its last sync.keep_versions versions readable)"
            )
        yield tensors


def receive(handle: TensorHandle, engine: LoadsTensors) -> None:
    """The engine gets the mapped tensors: shared memory it may hand on to its servers as it is."""
    engine.load_tensors(handle, read(handle))
