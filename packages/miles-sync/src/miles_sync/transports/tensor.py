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

With `sync.pipeline` the handle goes out before the data is in place: the buffers are allocated and serialized in
`publish`, and the copies run in the sender's own thread, bucket after bucket, while the engines load the buckets
already written (`wait()` ends them). Each buffer's header holds a state beside the version (being written, complete,
failed), written after the bucket's bytes; `read` waits for "complete" (`ready_timeout_s`) before it hands a bucket
on. A store is seen by another process in the order it was made on x86 (and the copy's threads are joined before the
state is written); on weaker memory models the state would need a fence.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for

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
from miles_sync.transports.base import BucketedSender, Transport
from miles_sync.types import NamedTensor, TensorHandle

NAME = "tensor"
ALIGN = 64  # every tensor starts at a multiple of this in its bucket's buffer (any element size divides it)
STAMP = "\x00stamp"
"""The first entry of every payload is named `STAMP <version> <publish number>` (not a weight's name) and maps the
buffer's header: the same two numbers as int64 (they differ once the buffer was reused), then the bucket's state."""
WRITING, READY, FAILED = 0, 1, 2
"""States of a bucket in its header: being copied, complete, the copy failed."""
QUEUED = 2
"""sync.pipeline: buckets waiting for the copying thread at most; `publish` waits beyond that, so that a push holds
a few buckets besides the trainer's weights (casts, quantized copies), not a second model."""

log = logging.getLogger(__name__)


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
        self._copier: ThreadPoolExecutor | None = None  # sync.pipeline: the thread that copies the buckets
        self._copies: list[Future] = []  # of the last version

    def _begin(self, weight_version: int) -> None:
        self.wait()  # the last version's copies end before a slot of the ring is written again
        self._slot = self._ring[self._published % len(self._ring)]  # the oldest kept version's: reused
        self._version = weight_version
        self._payloads: list[str] = []

    def _put_bucket(self, index: int, bucket: list[NamedTensor]) -> None:
        # A private copy in shared memory: the published version stays immutable while training goes on (pipelined:
        # once `wait()` returned).
        size = ALIGN + sum(_aligned(t.numel() * t.element_size()) for _, t in bucket)
        if index < len(self._slot) and self._slot[index].numel() >= size and _file_alive(self._slot[index]):
            buffer = self._slot[index]
        else:
            buffer = new_shared(size, torch.device("cuda") if bucket[0][1].is_cuda else torch.device("cpu"))
            replaced = self._slot[index:index + 1]  # fmt: skip
            self._slot[index:index + 1] = [buffer]  # fmt: skip
            self._drop(replaced)
        header = buffer[:24].view(torch.int64)
        header[0], header[1], header[2] = self._version, self._published, WRITING
        shared: list[NamedTensor] = [(f"{STAMP} {self._version} {self._published}", header)]
        offset = ALIGN
        for name, tensor in bucket:
            nbytes = tensor.numel() * tensor.element_size()
            shared.append((name, buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)))
            offset += _aligned(nbytes)
        self._payloads.append(serialize_bucket(shared))  # names the memory only: it may be filled afterwards
        if self.config.pipeline:
            if self._copier is None:
                self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-tensor-copy")
            queued = [f for f in self._copies if not f.done()]
            wait_for(queued[: max(0, len(queued) - QUEUED)])
            self._copies.append(self._copier.submit(_fill, header, shared[1:], bucket))
        else:
            _fill(header, shared[1:], bucket)

    def _finish(self, common: dict) -> TensorHandle:
        past = self._slot[common["num_buckets"] :]  # a smaller version: buckets past its last are not kept
        del self._slot[common["num_buckets"] :]
        self._drop(past)
        self._published += 1
        return TensorHandle(**common, payloads=self._payloads, ready_timeout_s=self.config.ready_timeout_s)

    def wait(self) -> None:
        """`sync.pipeline`: block until every bucket of the last version is written; raise the first copy's error."""
        errors = self._end_copies()
        if errors:
            raise errors[0]

    def _end_copies(self) -> list[BaseException]:
        """Wait for the copies in flight; their errors, without the copies' frames: those hold views of the buffers,
        which would outlive `close()` (and torch aborts a process that drops a shared tensor whose file is gone)."""
        copies, self._copies = self._copies, []
        errors = [exc for future in copies if (exc := future.exception()) is not None]
        del copies
        for exc in errors:
            exc.with_traceback(None)
        return errors

    def _drop(self, buffers: list[torch.Tensor]) -> None:
        """Free buffers taken out of the ring (their version is released; `buffers` holds the last reference),
        with the files unread payloads pin."""
        files = [f for b in buffers if (f := shm_file(b))]
        release_files([buffers], files)

    def close(self) -> None:
        for error in self._end_copies():  # the buffers are written to until then; an error nobody waited for:
            log.error("tensor transport: copying weight version %s failed: %r", self._version, error)
        if self._copier is not None:
            self._copier.shutdown()
            self._copier = None
        files = [f for slot in self._ring for b in slot if (f := shm_file(b))]
        keep = len(self._ring)
        release_files(self._ring, files)  # empties every slot in place (`_slot` too), then the ring
        self._ring = [[] for _ in range(keep)]


def _fill(header: torch.Tensor, views: list[NamedTensor], bucket: list[NamedTensor]) -> None:
    """Copy a bucket's tensors into their places in its buffer, then mark it complete (or failed) in its header."""
    try:
        for (_, view), (_, tensor) in zip(views, bucket, strict=True):
            view.copy_(tensor)
    except BaseException:
        header[2] = FAILED
        raise
    header[2] = READY


def _wait_ready(handle: TensorHandle, stamp: str, header: torch.Tensor) -> None:
    """Return once the bucket whose header this is was written for `handle`'s version; raise if its slot now holds
    another version, if the sender failed writing it, or after `ready_timeout_s`."""
    version = handle.weight_version
    deadline, pause = time.monotonic() + handle.ready_timeout_s, 1e-4
    while True:
        held_version, held_publish, state = (int(v) for v in header.tolist())
        if not stamp.startswith(STAMP) or stamp.split()[1:] != [str(held_version), str(held_publish)]:
            raise FileNotFoundError(
                f"weight version {version}: its shared memory now holds version {held_version} (the sender keeps its "
                "last sync.keep_versions versions readable)"
            )
        if state == READY:
            return
        if state == FAILED:
            raise RuntimeError(
                f"weight version {version}: the sender failed while copying it (its wait() raises the error; the "
                "trainer's log names it)"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"weight version {version}: a bucket was not written within {handle.ready_timeout_s} s "
                "(sync.ready_timeout_s): the sender stopped while copying it?"
            )
        time.sleep(pause)
        pause = min(2 * pause, 5e-3)


def read(handle: TensorHandle) -> Iterator[list[NamedTensor]]:
    """The buckets, mapped from the sender's shared memory (no copy), each once it is written."""
    for payload in handle.payloads:
        try:
            bucket = deserialize_bucket(payload)
        except (FileNotFoundError, RuntimeError) as exc:
            raise FileNotFoundError(
                f"weight version {handle.weight_version}: its shared memory is gone (released by the sender, "
                f"or another machine): {exc}"
            ) from None
        (stamp, header), *tensors = bucket
        _wait_ready(handle, stamp, header)
        yield tensors


def receive(handle: TensorHandle, engine: LoadsTensors) -> None:
    """The engine gets the mapped tensors: shared memory it may hand on to its servers as it is."""
    engine.load_tensors(handle, read(handle))


TRANSPORT = Transport(NAME, TensorSender, read, receive)
