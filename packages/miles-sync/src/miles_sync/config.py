"""Configuration of weight transfer. Imports only pydantic, so a job spec validates without torch."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

TransportName = Literal["inproc", "disk", "tensor", "broadcast"]
WireDtype = Literal["float32", "bfloat16", "float16"]
AUTO: Literal["auto"] = "auto"


def holds_exactly(held: str, sent: str) -> bool:
    """True when every value of dtype `sent` is exactly representable in dtype `held`: a receiver holding `held`
    keeps what it was sent bit for bit, and casting back gives the sent tensor."""
    return held == sent or (held == "float32" and sent in ("bfloat16", "float16"))


class SyncConfig(BaseModel):
    """How trainer weights reach the rollout engines."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # no inf or NaN: JSON and the store cannot hold them

    transport: TransportName = Field(
        "disk",
        description="inproc: tensors travel inside the handle (same process or Ray object store); "
        "disk: safetensors files in `dir`, one per bucket; tensor: shared memory (CUDA IPC on GPU), same "
        "machine only; broadcast: torch.distributed broadcast from the trainer to the engines (gloo | nccl).",
    )
    bucket_bytes: int = Field(64 * 1024 * 1024, gt=0, description="Maximum bytes per bucket.")
    dtype: WireDtype | Literal["auto"] | None = Field(
        AUTO,
        description="Cast floating-point weights to this dtype before sending. auto: the engines' dtype (the "
        "checkpoint's unless the engine config names another), so the engines receive exactly the values they "
        "hold and the weight check compares like with like; None: as the trainer holds them (fp32 master "
        "weights). A sender built outside a job treats auto as None.",
    )
    dir: str | None = Field(
        None, description="Folder for the disk transport; a temporary folder under the run when None."
    )
    keep_versions: int = Field(
        2, ge=1, description="disk and tensor transports: how many published versions to keep readable."
    )
    master_address: str = Field("127.0.0.1", description="broadcast: address the trainer's rank 0 listens on.")
    master_port: int | None = Field(
        None, ge=1, le=65535, description="broadcast: rendezvous port; a free port when None."
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="broadcast: process-group backend; auto is nccl with a GPU, gloo without."
    )
    timeout_s: float = Field(
        300.0, gt=0, description="broadcast: how long to wait for receivers to join or take a bucket."
    )
    check_weights: bool = Field(
        True, description="After every push, compare the engine's weight fingerprint with the trainer's."
    )

    def for_engines(self, engine_dtype: str) -> SyncConfig:
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
