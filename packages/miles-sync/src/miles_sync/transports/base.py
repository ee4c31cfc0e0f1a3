"""Shared shape of every sender: quantize → cast → bucket → fingerprint → hand each bucket to the transport."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from miles_sync.bucketing import cast_for_wire, iter_buckets, wire_dtype
from miles_sync.config import SyncBase
from miles_sync.fingerprint import Fingerprinter
from miles_sync.types import NamedTensor, NamedTensors, WeightHandle


class BucketedSender:
    """Base class: subclasses implement `_begin`, `_put_bucket` and `_finish`.

    `receiver_ranks` is how many receiving ranks a version goes to (`needs_receiver_ranks` senders only: the
    runtime asks the engines for it before building one)."""

    name = "base"
    needs_receiver_ranks = False
    from_every_rank = False
    """True: every trainer rank has a sender and publishes what it holds (a rank may hold nothing); False: rank 0
    publishes the full tensors."""

    def __init__(self, config: SyncBase, receiver_ranks: int = 1) -> None:
        self.config = config
        self.receiver_ranks = receiver_ranks
        self._dtype = wire_dtype(config.dtype)
        self._last: tuple[int, dict[str, bytes]] | None = None  # delta: the last version published, its digests

    def publish(self, named_tensors: NamedTensors, weight_version: int) -> WeightHandle:
        fp = Fingerprinter()
        num_tensors = num_bytes = num_buckets = 0
        base = self._last if self.config.delta else None
        unchanged = 0

        def changed(stream: NamedTensors) -> NamedTensors:
            """Every tensor is hashed; with a base version, only those whose digest differs go on (at least one,
            so that every push carries its version to the engines)."""
            nonlocal unchanged
            held_back: NamedTensor | None = None
            sent = 0
            for name, tensor in stream:
                digest = fp.add(name, tensor)
                if base is not None and base[1].get(name) == digest:
                    unchanged += 1
                    held_back = (name, tensor)
                    continue
                sent += 1
                yield name, tensor
            if sent == 0 and held_back is not None:
                unchanged -= 1
                yield held_back

        self._begin(weight_version)
        if self.config.quant_wire == "packed":  # fp8 values and fp32 scales travel as they are; the rest is cast
            from miles_sync.formats.packed import packed_for_push

            stream = packed_for_push(named_tensors, self.config.quantization, self._dtype)
        else:
            if self.config.quantization != "none":  # torchao loads only when a format is used
                from miles_sync.formats import quantized_for_push

                named_tensors = quantized_for_push(
                    named_tensors, self.config.quantization, self.config.quant_group_size
                )
            stream = cast_for_wire(named_tensors, self._dtype)
        for index, bucket in enumerate(iter_buckets(changed(stream), self.config.bucket_bytes)):
            for _, tensor in bucket:
                num_tensors += 1
                num_bytes += tensor.numel() * tensor.element_size()
            self._put_bucket(index, bucket)
            num_buckets += 1
        if num_tensors == 0 and not self._may_hold_nothing():
            raise ValueError("publish() got no tensors: refusing to publish an empty weight version")
        self._digests = fp.digests  # of every tensor published (and, with a base version, the unchanged ones)
        handle = self._finish(
            {
                "weight_version": weight_version,
                "num_tensors": num_tensors,
                "num_bytes": num_bytes,
                "num_buckets": num_buckets,
                "fingerprint": fp.hexdigest(),
                "dtype": None if self._dtype is None else self.config.dtype,
                "packed": self.config.quantization if self.config.quant_wire == "packed" else None,
                "base_version": None if base is None else base[0],
                "unchanged_tensors": unchanged,
            }
        )
        if self.config.delta:
            self._last = (weight_version, fp.digests)
        return handle

    def _may_hold_nothing(self) -> bool:
        """Whether this sender may publish no tensor (a trainer rank that holds none, when every rank sends)."""
        return False

    def forget_base(self) -> None:
        """The next push is whole (`sync.delta`): the engines may no longer hold the last version."""
        self._last = None

    def wait(self) -> None:
        """Block until the last published version has reached the receivers and raise the transport's error if
        it failed. The trainer must not change the published tensors before it returns (a pipelined `tensor` sender
        still copies them). Senders that finish inside `publish` (`disk`, `inproc`, `tensor` without
        `sync.pipeline`) return at once."""

    def close(self) -> None:
        pass

    def _begin(self, weight_version: int) -> None:
        pass

    def _put_bucket(self, index: int, bucket: list[NamedTensor]) -> None:
        raise NotImplementedError

    def _finish(self, common: dict) -> WeightHandle:
        """The transport's handle: `common` holds the fields every handle has (`WeightHandle`'s)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Transport:
    """What the registry knows of one transport: both halves, typed. Each transport module declares one
    (`TRANSPORT = Transport(...)`), and `miles_sync.transports` reaches every transport only through these.

    `sender` builds the trainer side (a `BucketedSender` subclass: its `needs_receiver_ranks` and
    `from_every_rank` say how it is built and who publishes); `read(handle)` yields the buckets of a published
    version in this process; `receive(handle, engine)` loads it into an engine through the capabilities the engine
    offers; `combine(handles)`, for a transport whose every trainer rank publishes a part, joins the parts into the
    handle of one version (None: rank 0 publishes the whole version)."""

    name: str
    sender: type[BucketedSender]
    read: Callable[..., Iterator[list[NamedTensor]]]
    receive: Callable[[Any, Any], None]
    combine: Callable[[list[Any]], WeightHandle] | None = None
