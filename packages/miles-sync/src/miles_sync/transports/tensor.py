"""tensor: buckets in shared memory, handed over as serialized tensor handles (no copy of the data).

Each bucket is moved into shared memory and pickled with torch's multiprocessing reducers
(`ForkingPickler`), then base64-encoded: the handle carries these short strings, and any process on
the same machine rebuilds the tensors from them without copying the bytes. This is the payload
format of SGLang's `/update_weights_from_tensor` (`serialized_named_tensors`). On GPU the same
reducers produce CUDA IPC handles for CUDA tensors.

On CPU the sharing strategy must be `file_system`: with `file_descriptor` the handle holds file
descriptors that only travel over a Unix socket, and an HTTP receiver such as SGLang rejects it.
`file_system` storages are files under /dev/shm. Torch reference-counts them, but every pickling adds
a reference that only an unpickling takes back, so a payload nobody reads would keep its file
forever. The sender keeps the last `keep_versions` versions readable; for older ones (and all on
`close()`) it drops its tensors and then unlinks the files that unread payloads still pin. A handle's
payload is meant to be read once per process: a receiver that hands tensors on (an engine feeding
several servers) re-serializes its own mapped tensors, one payload per reader.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import pickle
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.multiprocessing

from miles_sync.config import TensorSync
from miles_sync.transports.base import BucketedSender
from miles_sync.types import NamedTensor, WeightHandle


def use_file_system_sharing() -> None:
    """Process-wide: CPU shared-memory tensors are named files, so their handles survive JSON/HTTP."""
    if torch.multiprocessing.get_sharing_strategy() != "file_system":
        torch.multiprocessing.set_sharing_strategy("file_system")


def serialize_bucket(bucket: list[NamedTensor]) -> str:
    """Pickle `(name, tensor)` pairs with torch's shared-memory reducers; base64 text."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(bucket)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize_bucket(payload: str) -> list[NamedTensor]:
    # Payloads come from our own sender in a handle; they are never taken from a request body.
    return pickle.loads(base64.b64decode(payload))


class TensorSender(BucketedSender):
    name = "tensor"

    def __init__(self, config: TensorSync) -> None:
        super().__init__(config)
        use_file_system_sharing()
        self._alive: list[tuple[list[list[NamedTensor]], list[str]]] = []  # per kept version: buckets, shm files

    def _begin(self, weight_version: int) -> None:
        self._buckets: list[list[NamedTensor]] = []
        self._payloads: list[str] = []

    def _put_bucket(self, index: int, bucket: list[NamedTensor]) -> None:
        # A private copy in shared memory: the published version stays immutable while training goes on.
        shared = [(name, into_shared(tensor)) for name, tensor in bucket]
        self._buckets.append(shared)
        self._payloads.append(serialize_bucket(shared))

    def _finish(self, handle: WeightHandle) -> WeightHandle:
        files = [shm_file(tensor) for bucket in self._buckets for _, tensor in bucket]
        self._alive.append((self._buckets, [f for f in files if f]))
        while len(self._alive) > self.config.keep_versions:
            _release(*self._alive.pop(0))
        return dataclasses.replace(handle, payloads=self._payloads)

    def close(self) -> None:
        while self._alive:
            _release(*self._alive.pop(0))


def into_shared(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in shared memory, made with one copy of its bytes: the shared storage is allocated empty
    and filled (`clone().share_memory_()` copies twice, into private memory and then into shared memory)."""
    out = torch.empty_like(tensor, memory_format=torch.contiguous_format).share_memory_()
    out.copy_(tensor)
    return out


def shm_file(tensor: torch.Tensor) -> str | None:
    """The /dev/shm name behind a CPU tensor shared with the `file_system` strategy."""
    if tensor.device.type != "cpu":
        return None  # CUDA IPC memory is released with the tensor
    _, name, _ = tensor.untyped_storage()._share_filename_cpu_()
    return name.decode() if isinstance(name, bytes) else name


def release_shared(buckets: list[list[NamedTensor]]) -> None:
    """Free tensors this process put in shared memory, including files that unread payloads still pin.

    The tensors are dropped first: torch unlinks a file itself when its last reference goes, and aborts the
    process if the file is already gone then. Only files that survive (a payload nobody read keeps a
    reference) are unlinked here; processes that mapped them keep their memory.
    """
    files = [f for bucket in buckets for _, t in bucket if (f := shm_file(t))]
    _release(buckets, files)


def _release(buckets: list[list[NamedTensor]], files: list[str]) -> None:
    for bucket in buckets:
        bucket.clear()
    buckets.clear()
    for name in files:
        try:
            os.unlink(Path("/dev/shm") / name.lstrip("/"))
        except FileNotFoundError:
            pass


def read_tensor(handle: WeightHandle) -> Iterator[list[NamedTensor]]:
    if handle.payloads is None:
        raise ValueError(f"tensor handle for weight version {handle.weight_version} carries no payloads")
    for payload in handle.payloads:
        try:
            yield deserialize_bucket(payload)
        except (FileNotFoundError, RuntimeError) as exc:
            raise FileNotFoundError(
                f"weight version {handle.weight_version}: its shared memory is gone (released by the sender, "
                f"or another machine): {exc}"
            ) from None
