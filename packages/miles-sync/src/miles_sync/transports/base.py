"""Shared shape of every sender: quantize → cast → bucket → fingerprint → hand each bucket to the transport."""

from __future__ import annotations

from miles_sync.bucketing import cast_for_wire, iter_buckets, wire_dtype
from miles_sync.config import SyncBase
from miles_sync.fingerprint import Fingerprinter
from miles_sync.types import NamedTensor, NamedTensors, WeightHandle


class BucketedSender:
    """Base class: subclasses implement `_begin`, `_put_bucket` and `_finish`."""

    name = "base"

    def __init__(self, config: SyncBase) -> None:
        self.config = config
        self._dtype = wire_dtype(config.dtype)

    def publish(self, named_tensors: NamedTensors, weight_version: int) -> WeightHandle:
        fp = Fingerprinter()
        num_tensors = num_bytes = num_buckets = 0
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
        for index, bucket in enumerate(iter_buckets(stream, self.config.bucket_bytes)):
            for name, tensor in bucket:
                fp.add(name, tensor)
                num_tensors += 1
                num_bytes += tensor.numel() * tensor.element_size()
            self._put_bucket(index, bucket)
            num_buckets += 1
        if num_tensors == 0:
            raise ValueError("publish() got no tensors: refusing to publish an empty weight version")
        return self._finish(
            WeightHandle(
                transport=self.name,
                weight_version=weight_version,
                num_tensors=num_tensors,
                num_bytes=num_bytes,
                num_buckets=num_buckets,
                fingerprint=fp.hexdigest(),
                dtype=None if self._dtype is None else self.config.dtype,
                packed=self.config.quantization if self.config.quant_wire == "packed" else None,
            )
        )

    def wait(self) -> None:
        """Block until the last published version has reached the receivers and raise the transport's error if
        it failed. Senders that finish inside `publish` (all but broadcast) return at once."""

    def close(self) -> None:
        pass

    def _begin(self, weight_version: int) -> None:
        pass

    def _put_bucket(self, index: int, bucket: list[NamedTensor]) -> None:
        raise NotImplementedError

    def _finish(self, handle: WeightHandle) -> WeightHandle:
        raise NotImplementedError
