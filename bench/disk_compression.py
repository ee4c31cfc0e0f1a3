"""Disk transport: bytes written and time per push, plain safetensors against zstd (byte-shuffled), whole and delta.

Weights are bf16 tensors drawn like a trained model's (normal, std 0.02) in layers of equal size; the delta push
follows a step that moved half the layers. Each configuration publishes (write) and reads back (what an engine's
process does for a compressed or delta version); bytes are what lands in the version folder. Run:

    .venv/bin/python bench/disk_compression.py            # 256 MB of weights
    .venv/bin/python bench/disk_compression.py --mb 32    # quicker
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from miles_sync import build_sender, read_buckets, sync_config


def weights(total_mb: int, layers: int = 16) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    rows = total_mb * 2**20 // (layers * 1024 * 2)
    return [
        (f"layers.{i}.weight", (torch.randn(rows, 1024, generator=g) * 0.02).to(torch.bfloat16)) for i in range(layers)
    ]


def on_disk(location: str) -> int:
    return sum(f.stat().st_size for f in Path(location).glob("bucket-*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="megabytes of bf16 weights")
    parser.add_argument("--quick", action="store_true", help="8 MB of weights (CI)")
    parser.add_argument("--out", type=Path, help="also write the report here (Markdown)")
    args = parser.parse_args()
    if args.quick:
        args.mb = 8
    base = weights(args.mb)
    moved = [(n, t + 0.001 if i % 2 else t) for i, (n, t) in enumerate(base)]
    raw = sum(t.numel() * t.element_size() for _, t in base)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for compression in ("none", "zstd"):
            config = sync_config(transport="disk", dir=f"{tmp}/{compression}", delta=True, compression=compression)
            sender = build_sender(config)
            for label, tensors, version in (("whole", base, 1), ("delta", moved, 2)):
                start = time.perf_counter()
                handle = sender.publish(tensors, weight_version=version)
                write_s = time.perf_counter() - start
                start = time.perf_counter()
                for _ in read_buckets(handle):
                    pass
                read_s = time.perf_counter() - start
                rows.append((compression, label, on_disk(handle.location), write_s, read_s))
            sender.close()
    plain = {label: size for c, label, size, *_ in rows if c == "none"}
    lines = [
        f"# disk transport, {raw / 2**20:.0f} MB of bf16 weights (16 layers; the delta moved 8)",
        "",
        "| compression | push | MB on disk | vs plain whole | write s | read s |",
        "|---|---|---|---|---|---|",
    ]
    for compression, label, size, write_s, read_s in rows:
        lines.append(
            f"| {compression} | {label} | {size / 2**20:.1f} | {size / plain['whole']:.2f} | {write_s:.3f} | "
            f"{read_s:.3f} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
