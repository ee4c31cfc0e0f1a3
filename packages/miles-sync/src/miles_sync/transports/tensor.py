"""tensor: buckets in shared memory, handed over as serialized tensor handles (no copy of the data).

Each bucket is copied once into shared memory and serialized (`miles_sync.shared`): the handle carries these
short strings, and any process on the same machine rebuilds the tensors from them without copying the bytes
(CUDA IPC handles for CUDA tensors). Every pickling pins a /dev/shm file that only an unpickling releases, so the
sender keeps the last `keep_versions` versions readable; for older ones (and all on `close()`) it drops its
tensors and then unlinks the files that unread payloads still pin. A handle's payload is meant to be read once
per process: a receiver that hands tensors on (an engine feeding several servers) re-serializes its own mapped
tensors, one payload per reader.
"""

from __future__ import annotations

from collections.abc import Iterator

from miles_sync.config import TensorSync
from miles_sync.protocol import LoadsTensors
from miles_sync.shared import (
    deserialize_bucket,
    into_shared,
    release_files,
    serialize_bucket,
    shm_file,
    use_file_system_sharing,
)
from miles_sync.transports.base import BucketedSender
from miles_sync.types import NamedTensor, TensorHandle

NAME = "tensor"


class TensorSender(BucketedSender):
    name = NAME

    def __init__(self, config: TensorSync, receiver_ranks: int = 1) -> None:
        super().__init__(config, receiver_ranks)
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

    def _finish(self, common: dict) -> TensorHandle:
        files = [shm_file(tensor) for bucket in self._buckets for _, tensor in bucket]
        self._alive.append((self._buckets, [f for f in files if f]))
        while len(self._alive) > self.config.keep_versions:
            release_files(*self._alive.pop(0))
        return TensorHandle(**common, payloads=self._payloads)

    def close(self) -> None:
        while self._alive:
            release_files(*self._alive.pop(0))


Sender = TensorSender


def read(handle: TensorHandle) -> Iterator[list[NamedTensor]]:
    """The buckets, mapped from the sender's shared memory (no copy)."""
    for payload in handle.payloads:
        try:
            yield deserialize_bucket(payload)
        except (FileNotFoundError, RuntimeError) as exc:
            raise FileNotFoundError(
                f"weight version {handle.weight_version}: its shared memory is gone (released by the sender, "
                f"or another machine): {exc}"
            ) from None


def receive(handle: TensorHandle, engine: LoadsTensors) -> None:
    """The engine gets the mapped tensors: shared memory it may hand on to its servers as it is."""
    engine.load_tensors(handle, read(handle))
