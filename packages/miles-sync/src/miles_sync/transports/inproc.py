"""inproc: the tensors travel inside the handle.

In one process this is a hand-over of references; between Ray actors the handle goes through
Ray's object store. It is the reference transport the others are checked against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from miles_sync.transports.base import BucketedSender
from miles_sync.types import NamedTensor, WeightHandle


class InprocSender(BucketedSender):
    name = "inproc"

    def _begin(self, weight_version: int) -> None:
        self._buckets: list[list[NamedTensor]] = []

    def _put_bucket(self, index: int, bucket: list[NamedTensor]) -> None:
        # Cloning keeps the published version immutable while the trainer keeps updating its tensors.
        self._buckets.append([(name, tensor.clone()) for name, tensor in bucket])

    def _finish(self, handle: WeightHandle) -> WeightHandle:
        return dataclasses.replace(handle, buckets=self._buckets)


def read_inproc(handle: WeightHandle) -> Iterator[list[NamedTensor]]:
    if handle.buckets is None:
        raise ValueError(f"inproc handle for weight version {handle.weight_version} carries no tensors")
    yield from handle.buckets
