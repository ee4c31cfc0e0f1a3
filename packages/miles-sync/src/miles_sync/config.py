"""Configuration of weight transfer. Imports only pydantic, so a job spec validates without torch."""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    model_validator,
)

TransportName = Literal["inproc", "disk", "tensor", "broadcast", "p2p"]
WireDtype = Literal["float32", "bfloat16", "float16"]
# Low-precision formats of `miles_sync.formats` (kept here as names so a spec validates without torch).
QuantFormat = Literal["none", "fp8", "fp8_block", "mxfp8", "nvfp4", "int4"]
QuantWire = Literal["values", "packed"]
QUANT_DESCRIPTION = (
    "none | fp8 (E4M3, per-tensor scale) | fp8_block (E4M3, 128×128 block scales) | mxfp8 (OCP MX: 32-element "
    "blocks, E8M0 scale) | nvfp4 (E2M1, 16-element blocks, E4M3 block scale + fp32 tensor scale) | int4 "
    "(symmetric, quant_group_size groups). Applies to the 2-D weights of linear layers only."
)
AUTO: Literal["auto"] = "auto"


def holds_exactly(held: str, sent: str) -> bool:
    """True when every value of dtype `sent` is exactly representable in dtype `held`: a receiver holding `held`
    keeps what it was sent bit for bit, and casting back gives the sent tensor."""
    return held == sent or (held == "float32" and sent in ("bfloat16", "float16"))


def _types(annotation: Any) -> set[Any]:
    """The plain types an annotation admits, through unions, Optional and Literal (whose values count by type)."""
    if typing.get_origin(annotation) is Literal:
        return {type(v) for v in typing.get_args(annotation)}
    args = typing.get_args(annotation)
    return set().union(*(_types(a) for a in args)) if args else {annotation}


def _number_only(model: type[BaseModel], name: str) -> bool:
    """Whether field `name` of `model` takes numbers and not booleans."""
    types = _types(model.model_fields[name].annotation)
    return bool(types & {int, float}) and bool not in types


class SpecModel(BaseModel):
    """The base of every section of a job spec, in every package: unknown fields are errors, no inf or NaN (JSON and
    the store cannot hold them), and a number field refuses `true` / `false` (pydantic would read `num_steps: true`
    as 1: a typo must not become a setting)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, value in data.items():
                if isinstance(value, bool) and name in cls.model_fields and _number_only(cls, name):
                    raise ValueError(f"{name}: expected a number, got {str(value).lower()}")
        return data


class SyncBase(SpecModel):
    """Fields every transport has; one subclass per transport adds its own (`SyncConfig` is their union,
    told apart by `transport`)."""

    transport: TransportName
    bucket_bytes: int = Field(64 * 1024 * 1024, gt=0, description="Maximum bytes per bucket.")
    dtype: WireDtype | Literal["auto"] | None = Field(
        AUTO,
        description="Cast floating-point weights to this dtype before sending. auto: the engines' dtype (the "
        "checkpoint's unless the engine config names another), so the engines receive exactly the values they "
        "hold and the weight check compares like with like; None: as the trainer holds them (fp32 master "
        "weights). A sender built outside a job treats auto as None.",
    )
    check_weights: bool = Field(
        True, description="After every push, compare the engine's weight fingerprint with the trainer's."
    )
    check_after_resume: bool = Field(
        False,
        description="Run the weight check after the engines resume generating instead of before, so the pause "
        "covers the load only. The engines keep the previous version until the next push; a failed check rolls "
        "them back to it (SGLang: reloaded into every server and verified) and fails the step. Needs check_weights.",
    )
    quantization: QuantFormat = Field(
        "none",
        description="Quantize the linear layers' weights before each push, so the engines generate with them: "
        + QUANT_DESCRIPTION
        + " On CPU the engines receive the dequantized values of the format's grid (weight-only emulation).",
    )
    quant_group_size: int = Field(128, gt=0, description="quantization: int4's group along the input dimension.")
    quant_wire: QuantWire = Field(
        "values",
        description="How quantized weights travel. values: as the dequantized values of the format's grid in the "
        "wire dtype (every engine, every format; weight-only emulation). packed: as the format's own bytes and "
        "scales, loaded by an engine that runs real low-precision kernels on them: SGLang on a GPU, "
        "quantization: fp8_block, transport: tensor (miles_sync.formats.packed says why only those).",
    )
    delta: bool = Field(
        False,
        description="Send only the tensors that changed since the previous push (compared in the wire dtype, by "
        "their fingerprint digests), a frozen layer or an embedding that did not move staying where it is; the "
        "first push of a sender is whole. The engines must hold the previous version (refused otherwise) and "
        "their fingerprint is still of the whole model. Not with p2p; on disk a delta version holds only the "
        "changed tensors (read in the engine's process and handed on as tensors).",
    )

    lora: Literal["adapter", "merge"] = Field(
        "adapter",
        description="With train.lora, what a push sends. adapter: the adapter's matrices alone (PEFT's names, "
        "0.1–2 % of the model's bytes), which the engine applies to the base it holds (hf: PEFT; sglang: each version "
        "loaded by name with SGLang's LoRA support, and generation never pauses for a push); merge: the merged "
        "weights W + (alpha / rank) · B A under the model's own names, pushed and checked as a full model. The weight "
        "check compares what was sent. No effect without train.lora.",
    )

    @model_validator(mode="after")
    def _packed_needs(self) -> Self:
        if self.check_after_resume and not self.check_weights:
            raise ValueError("sync.check_after_resume needs sync.check_weights: true (it moves that check)")
        if self.delta and self.quant_wire == "packed":
            raise ValueError(
                "sync.delta with sync.quant_wire: packed is not supported: an fp8 weight and its scales must travel "
                "together, and a delta may change one without the other; use quant_wire: values or delta: false"
            )
        if self.quant_wire == "packed":
            if self.quantization != "fp8_block":
                raise ValueError(
                    f"sync.quant_wire: packed needs sync.quantization: fp8_block (got {self.quantization!r}): the "
                    "other formats' packed layouts cannot be updated in place on an engine; use quant_wire: values"
                )
            if self.transport != "tensor":
                raise ValueError(
                    f"sync.quant_wire: packed travels on sync.transport: tensor (got {self.transport!r}), the path "
                    "SGLang loads packed fp8 updates through"
                )
        return self

    def placed(self, run_dir: str) -> Self:
        """This config with what it leaves to the run (a folder) filled in under `run_dir`."""
        return self

    def for_engines(self, engine_dtype: str) -> Self:
        """This config with `dtype: auto` resolved to the dtype the engines hold. A wire dtype the engines cannot
        hold exactly is refused while `check_weights` is on: they would round what they receive, and no push
        could pass the check."""
        dtype = engine_dtype if self.dtype == AUTO else self.dtype
        if self.check_weights and dtype is not None and not holds_exactly(engine_dtype, dtype):
            raise ValueError(
                f"sync.dtype: {dtype} is not what the engines hold ({engine_dtype}): they would round every push "
                f"and the weight check could never pass; use sync.dtype: auto (sends {engine_dtype}), or "
                "sync.check_weights: false"
            )
        if self.check_weights and dtype is None and engine_dtype != "float32":
            raise ValueError(
                f"sync.dtype: null sends the trainer's fp32 master weights, which the engines round to "
                f"{engine_dtype}: the weight check could never pass; use sync.dtype: auto, or "
                "sync.check_weights: false"
            )
        return self.model_copy(update={"dtype": dtype})

    def pushed_precision(self, engine_dtype: str) -> str:
        """The precision of the weights the engines run after a push of this (resolved) config: the wire dtype
        when the engines hold it exactly (bf16 sent to fp32 engines is bf16 there), else the engines' own."""
        if self.dtype in (None, AUTO) or not holds_exactly(engine_dtype, self.dtype):
            return engine_dtype
        return self.dtype


class InprocSync(SyncBase):
    """inproc: tensors travel inside the handle (same process, or Ray's object store)."""

    transport: Literal["inproc"] = "inproc"


class DiskSync(SyncBase):
    """disk: safetensors files, one per bucket, in a version folder under `dir` (a shared path across nodes)."""

    transport: Literal["disk"] = "disk"
    dir: str | None = Field(None, description="Folder of the published versions; `weights/` under the run when None.")
    keep_versions: int = Field(2, ge=1, description="How many published versions stay readable.")
    compression: Literal["none", "zstd"] = Field(
        "none",
        description="zstd: each bucket is one zstd frame of its tensors' bytes, byte-shuffled (bf16 weights "
        "compress ~1.46×); for a shared path slower than compression. Such a version (and a delta) is read in "
        "the engine's process and handed to its servers as tensors, not read by the servers from the folder.",
    )
    compression_level: int = Field(1, ge=1, le=22, description="compression: zstd's level (1: fastest).")

    def placed(self, run_dir: str) -> Self:
        return self if self.dir is not None else self.model_copy(update={"dir": run_dir})


class TensorSync(SyncBase):
    """tensor: shared memory handles (same machine only)."""

    transport: Literal["tensor"] = "tensor"
    keep_versions: int = Field(2, ge=1, description="How many published versions stay readable.")
    pipeline: bool = Field(
        True,
        description="Hand out the version before its buckets are copied: the copies run in the sender's thread while "
        "the engines load the buckets already written (each bucket's header says when it is complete). The trainer "
        "must not change its weights before `wait()` (the runtime waits before the next step). false: every copy "
        "ends inside `publish`.",
    )
    ready_timeout_s: float = Field(
        120.0, gt=0, description="pipeline: how long a receiver waits for one bucket to be written."
    )


class GroupSync(SyncBase):
    """Fields of the transports whose versions travel in a torch.distributed group (`broadcast`, `p2p`)."""

    master_address: str = Field(
        "127.0.0.1",
        description="Address the trainer's rank 0 listens on and the other ranks connect to; 0.0.0.0: every "
        "interface, advertising this host's address (receivers or trainer ranks on other nodes).",
    )
    master_port: int | None = Field(None, ge=1, le=65535, description="Rendezvous port; a free port when None.")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Process-group backend; auto is nccl with a GPU, gloo without."
    )
    timeout_s: float = Field(300.0, gt=0, description="How long to wait for receivers to join or take a bucket.")


class BroadcastSync(GroupSync):
    """broadcast: torch.distributed broadcast from the trainer's rank 0 to every engine rank."""

    transport: Literal["broadcast"] = "broadcast"


class P2PSync(GroupSync):
    """p2p: every trainer rank sends the tensors (or row shards) it holds straight to each receiving rank, over
    torch.distributed point-to-point calls; no gather on rank 0."""

    transport: Literal["p2p"] = "p2p"
    max_buckets_in_flight: int = Field(
        8,
        ge=1,
        description="How many buckets a receiving rank has receives posted for at once, across senders: at most "
        "that many buckets' bytes are allocated there at a time (on its GPU with NCCL).",
    )

    @model_validator(mode="after")
    def _p2p_sends_values(self) -> Self:
        for name, value, ok in (
            ("quantization", self.quantization, self.quantization == "none"),
            ("delta", self.delta, not self.delta),
        ):
            if not ok:
                raise ValueError(
                    f"sync.transport: p2p does not support sync.{name}: {value}: each rank sends row shards of "
                    "tensors, which a block format's scales and a delta's per-tensor digests do not split along; "
                    "use sync.transport: broadcast or tensor"
                )
        return self


DEFAULT_TRANSPORT: TransportName = "disk"


def _transport_of(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("transport", DEFAULT_TRANSPORT)
    return getattr(value, "transport", DEFAULT_TRANSPORT)


SyncConfig = Annotated[
    Annotated[InprocSync, Tag("inproc")]
    | Annotated[DiskSync, Tag("disk")]
    | Annotated[TensorSync, Tag("tensor")]
    | Annotated[BroadcastSync, Tag("broadcast")]
    | Annotated[P2PSync, Tag("p2p")],
    Discriminator(
        _transport_of,
        custom_error_type="unknown_transport",
        custom_error_message="sync.transport must be one of inproc, disk, tensor, broadcast, p2p",
    ),
]
"""The weight-transfer section of a job: one model per transport, chosen by `transport` (default: disk)."""

_ADAPTER: TypeAdapter[SyncConfig] = TypeAdapter(SyncConfig)


def sync_config(**fields: Any) -> SyncConfig:
    """A validated `SyncConfig` from keyword fields (`transport` picks the model; default disk)."""
    return _ADAPTER.validate_python(fields)
