"""The buckets of a version handed to every server's load as they arrive (a streamed, pipelined load)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from miles_sync import NamedTensor


class StreamBroken(RuntimeError):
    """The version's stream ended early (the receiver failed): a server's load stops at the bucket it reached."""


class BucketStream:
    """Buckets put by one producer, read by several consumers: each iteration is one reader that gets every bucket
    in order, waiting for the next one until the stream is closed. A stream closed as failed stops its readers with
    `StreamBroken` at their next bucket."""

    def __init__(self) -> None:
        self.buckets: list[list[NamedTensor]] = []
        self._closed = False
        self._failed = False
        self._changed = threading.Condition()

    def put(self, bucket: list[NamedTensor]) -> None:
        with self._changed:
            self.buckets.append(bucket)
            self._changed.notify_all()

    def close(self, failed: bool = False) -> None:
        with self._changed:
            self._closed, self._failed = True, failed
            self._changed.notify_all()

    def __iter__(self) -> Iterator[list[NamedTensor]]:
        index = 0
        while True:
            with self._changed:
                while not self._closed and index == len(self.buckets):
                    self._changed.wait()
                if self._failed:
                    raise StreamBroken("the version's stream broke off before its last bucket")
                if index == len(self.buckets):
                    return
                bucket = self.buckets[index]
            index += 1
            yield bucket
