"""`miles bench weights`: what each transport costs per byte and per bucket here, and what that projects to.

**Measured.** Each transport pushes synthetic fp32 weights (1 MiB tensors) at several total sizes and bucket
sizes, from `publish` until a receiver in this process holds every bucket (`read_buckets`: the disk files
read back, the shared-memory tensors mapped, the gloo broadcast or point-to-point sends taken by a receiving
thread), median of a few pushes. A least-squares fit of

    t = t0 + n_buckets · t_bucket + bytes · t_byte

gives the transport's fixed, per-bucket and per-byte costs on this machine (with the fit's R²), beside the
per-byte cost of a plain memory copy measured in the same run. The engine's own load (SGLang re-laying out
its fused tensors) is not in it: `bench/weight_update.py` measures the whole update into a real server.

**Projected.** For P parameters of d bytes (S = P·d), R sending ranks each holding S/R bytes, buckets of B
bytes, E engines and a link of L GB/s per sender:

    T = t0 + ceil(S / (R·B)) · t_bucket + (S / R) · max(t_byte, fanout / L)

fanout is how many times a sender puts each byte on its link: 1 for `broadcast` (the group forwards it:
NCCL's ring or tree), E for `disk` (each engine reads the shared folder) and `tensor` (same node only: L is
then the GPU-to-GPU bandwidth, CUDA IPC) and `p2p` (each sender to each engine). R applies to `p2p` only, whose
every trainer rank sends the shards it holds; the others send from the trainer's rank 0 (R = 1). Measured here
with one sending rank: R ranks sending at once is the projection's assumption, checked for correctness (each
rank sends its own bytes, once per receiver) but not for speed on this 2-core machine. Miles' published figure (1 T parameters in 7.2 s) is printed beside it as a claim, not a
measurement: nothing here ran on a GPU or a network.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
TRANSPORTS = ("disk", "tensor", "broadcast", "p2p")
CONCURRENT = ("broadcast", "p2p")  # the sender's thread sends while a receiving rank takes the buckets
CLAIM = "1 T parameters in 7.2 s (Miles' published figure; a claim, not measured here)"
CLAIM_PARAMS, CLAIM_SECONDS = 1e12, 7.2


@dataclass(frozen=True)
class Point:
    transport: str
    num_bytes: int
    bucket_bytes: int
    num_buckets: int
    seconds: float


@dataclass(frozen=True)
class Fit:
    transport: str
    t0: float
    t_bucket: float
    t_byte: float
    r2: float
    points: int

    @property
    def gb_per_s(self) -> float:
        return 1e-9 / self.t_byte if self.t_byte > 0 else math.inf


@dataclass(frozen=True)
class Scale:
    """What the projection is for: P parameters of `bytes_per_param`, R senders, E engines, L GB/s links."""

    params: float = CLAIM_PARAMS
    bytes_per_param: float = 2.0
    senders: int = 1
    engines: int = 8
    link_gb_s: float = 50.0
    bucket_bytes: int = 1 << 30


def _weights(num_bytes: int):
    import torch

    count = max(1, num_bytes // MIB)
    return [(f"layer.{i}.weight", torch.randn(MIB // 4)) for i in range(count)]


def _sender(transport: str, bucket_bytes: int, folder: Path):
    from miles_sync import build_sender, sync_config

    fields: dict = {"transport": transport, "bucket_bytes": bucket_bytes, "dtype": None, "keep_versions": 1}
    if transport == "disk":
        fields["dir"] = str(folder)
    if transport in CONCURRENT:
        fields.pop("keep_versions")
    return build_sender(sync_config(**fields), receiver_ranks=1)


def _push(sender, weights, version: int) -> tuple[float, int]:
    """Seconds from publish until every bucket is held by a receiver in this process; number of buckets."""
    from miles_sync import read_buckets

    transport = sender.name
    received: list = []
    try:
        start = time.perf_counter()
        handle = sender.publish(weights, weight_version=version)
        if transport in CONCURRENT:
            thread = threading.Thread(target=lambda: received.extend(read_buckets(handle)), daemon=True)
            thread.start()
            sender.wait()
            thread.join(60)
        else:
            received.extend(read_buckets(handle))
        seconds = time.perf_counter() - start
        if sum(len(b) for b in received) != len(weights):
            raise RuntimeError(f"{transport}: {sum(len(b) for b in received)} of {len(weights)} tensors arrived")
        return seconds, handle.num_buckets
    finally:
        received.clear()  # mapped shared memory goes before the sender reuses or unlinks it (torch aborts otherwise)


def memcpy_seconds_per_byte(num_bytes: int) -> float:
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / num_bytes


def measure(
    sizes_mb: Sequence[int],
    buckets_mb: Sequence[int],
    transports: Sequence[str] = TRANSPORTS,
    repeats: int = 3,
    on_point: Callable[[Point], None] = lambda p: None,
) -> list[Point]:
    """Every transport at every (total size, bucket size); the median of `repeats` pushes after a warm-up."""
    points = []
    with tempfile.TemporaryDirectory(prefix="miles-bench-weights-") as tmp:
        for size in sizes_mb:
            weights = _weights(size * MIB)
            for bucket in buckets_mb:
                for transport in transports:
                    # One sender for the warm-up and the measured pushes, as in a run: a sender that reuses its
                    # buffers (tensor) is measured in its steady state.
                    sender = _sender(transport, bucket * MIB, Path(tmp))
                    try:
                        runs = [_push(sender, weights, version) for version in range(1, repeats + 2)][1:]
                    finally:
                        sender.close()
                    point = Point(
                        transport, size * MIB, bucket * MIB, runs[0][1], statistics.median(s for s, _ in runs)
                    )
                    points.append(point)
                    on_point(point)
    return points


def fit(points: Sequence[Point]) -> list[Fit]:
    """Per transport, the least-squares t0, t_bucket, t_byte (negative terms clipped to 0 and refitted)."""
    import numpy as np

    fits = []
    for transport in dict.fromkeys(p.transport for p in points):
        mine = [p for p in points if p.transport == transport]
        y = np.array([p.seconds for p in mine])
        columns = {
            "t0": np.ones(len(mine)),
            "t_bucket": np.array([p.num_buckets for p in mine], dtype=float),
            "t_byte": np.array([p.num_bytes for p in mine], dtype=float),
        }
        active = list(columns)
        while True:
            coef, *_ = np.linalg.lstsq(np.column_stack([columns[c] for c in active]), y, rcond=None)
            negative = [c for c, v in zip(active, coef, strict=True) if v < 0]
            if not negative or len(active) == 1:
                break
            active.remove(negative[0])  # a cost cannot be negative: drop the term the noise made so
        values = dict.fromkeys(columns, 0.0) | {c: max(0.0, float(v)) for c, v in zip(active, coef, strict=True)}
        predicted = sum(values[c] * columns[c] for c in columns)
        total = float(((y - y.mean()) ** 2).sum())
        r2 = 1.0 - float(((y - predicted) ** 2).sum()) / total if total > 0 else 1.0
        fits.append(Fit(transport, values["t0"], values["t_bucket"], values["t_byte"], r2, len(mine)))
    return fits


def sending_ranks(transport: str, scale: Scale) -> int:
    """R of the formula: `p2p` sends from every trainer rank, the others from rank 0."""
    return scale.senders if transport == "p2p" else 1


def fanout(transport: str, engines: int) -> int:
    return 1 if transport == "broadcast" else engines


def project(f: Fit, scale: Scale) -> dict[str, float]:
    """The projected update time of `scale` for a transport with the fitted costs (see the module docstring)."""
    total = scale.params * scale.bytes_per_param
    per_sender = total / sending_ranks(f.transport, scale)
    buckets = math.ceil(per_sender / scale.bucket_bytes)
    link = fanout(f.transport, scale.engines) / (scale.link_gb_s * 1e9)
    per_byte = max(f.t_byte, link)
    return {
        "seconds": f.t0 + buckets * f.t_bucket + per_sender * per_byte,
        "buckets": buckets,
        "bucket_s": buckets * f.t_bucket,
        "byte_s": per_sender * per_byte,
        "bound": "link" if link > f.t_byte else "this machine",
    }


def report(points: Sequence[Point], fits: Sequence[Fit], memcpy_byte: float, scale: Scale, machine: str) -> str:
    def ms(seconds: float) -> str:
        return f"{seconds * 1000:,.3g}"

    lines = [
        "# Weight transports: costs here and a projection",
        "",
        f"Machine: {machine}. Synthetic fp32 weights in 1 MiB tensors; time from `publish` until a receiver in "
        "this process holds every bucket (median of the pushes after a warm-up). The engine's own load is not "
        "included (`bench/weight_update.py` measures it into a real SGLang server).",
        "",
        "## Measured",
        "",
        "| transport | MB | bucket MB | buckets | ms |",
        "|---|---|---|---|---|",
    ]
    for p in points:
        lines.append(
            f"| {p.transport} | {p.num_bytes / MIB:g} | {p.bucket_bytes / MIB:g} | {p.num_buckets} | {ms(p.seconds)} |"
        )
    lines += [
        "",
        "Fit `t = t0 + n_buckets · t_bucket + bytes · t_byte` (least squares; a term the noise makes negative "
        f"is set to 0). Memory copy here: {1e-9 / memcpy_byte:.2f} GB/s.",
        "",
        "| transport | t0 ms | per bucket ms | per GB s | GB/s | per byte / memcpy | R² | points |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in fits:
        lines.append(
            f"| {f.transport} | {ms(f.t0)} | {ms(f.t_bucket)} | {f.t_byte * 1e9:.3g} | {f.gb_per_s:.3g} | "
            f"{f.t_byte / memcpy_byte:.3g} | {f.r2:.3f} | {f.points} |"
        )
    total = scale.params * scale.bytes_per_param
    lines += [
        "",
        "## Projected",
        "",
        f"{scale.params:.3g} parameters × {scale.bytes_per_param:g} bytes = {total / 1e9:,.0f} GB; "
        f"{scale.senders} sending rank(s) ({total / scale.senders / 1e9:,.1f} GB each), buckets of "
        f"{scale.bucket_bytes / MIB:,.0f} MiB, {scale.engines} engine(s), {scale.link_gb_s:g} GB/s per link.",
        "",
        "`T = t0 + ceil(S / (R·B)) · t_bucket + (S / R) · max(t_byte, fanout / L)`; fanout 1 for broadcast, "
        "E for disk, tensor and p2p; R for p2p only (every trainer rank sends its shards), 1 for the others (rank 0 "
        "sends)."
        + (
            f" **R = {scale.senders} is the projection's assumption**: measured here from one sending rank."
            if scale.senders > 1
            else ""
        ),
        "",
        "| transport | projected s | buckets | of which per-bucket s | per-byte s | per-byte bound by |",
        "|---|---|---|---|---|---|",
    ]
    for f in fits:
        p = project(f, scale)
        lines.append(
            f"| {f.transport} | {p['seconds']:,.1f} | {p['buckets']:,} | {p['bucket_s']:,.2f} | {p['byte_s']:,.1f} | "
            f"{p['bound']} |"
        )
    claim_bytes = CLAIM_PARAMS * scale.bytes_per_param
    lines += [
        "",
        f"Beside it: {CLAIM}. At {scale.bytes_per_param:g} bytes a parameter that is {claim_bytes / 1e12:g} TB in "
        f"{CLAIM_SECONDS:g} s, {claim_bytes / CLAIM_SECONDS / 1e9:,.0f} GB/s in aggregate: "
        f"{math.ceil(claim_bytes / CLAIM_SECONDS / (scale.link_gb_s * 1e9))} links of {scale.link_gb_s:g} GB/s "
        "busy the whole time, which only many senders in parallel (point-to-point, no gather on one rank) can do.",
        "",
    ]
    return "\n".join(lines)
