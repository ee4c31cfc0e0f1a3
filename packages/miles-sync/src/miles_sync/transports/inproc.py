"""inproc: the tensors travel inside the handle.

In one process this is a hand-over of references; between Ray actors the handle goes through
Ray's object store. It is the reference transport the others are checked against.
"""

from __future__ import annotations

from collections.abc import Iterator

from miles_sync.protocol import LoadsTensors
from miles_sync.transports.base import BucketedSender, Transport
from miles_sync.types import InprocHandle, NamedTensor

NAME = "inproc"


class InprocSender(BucketedSender):
    name = NAME

    def _begin(self, weight_version: int) -> None:
        self._buckets: list[list[NamedTensor]] = []

    def _put_bucket(self, index: int, bucket: list[NamedTensor]) -> None:
        # Cloning keeps the published version immutable while the trainer keeps updating its tensors.
        self._buckets.append([(name, tensor.clone()) for name, tensor in bucket])

    def _finish(self, common: dict) -> InprocHandle:
        return InprocHandle(**common, buckets=self._buckets)


def read(handle: InprocHandle) -> Iterator[list[NamedTensor]]:
    yield from handle.buckets


def receive(handle: InprocHandle, engine: LoadsTensors) -> None:
    engine.load_tensors(handle, read(handle))


TRANSPORT = Transport(NAME, InprocSender, read, receive)
