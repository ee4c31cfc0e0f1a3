"""Weight-update latency per transport into a real SGLang server, against a plain memory copy.

For models of a few sizes (random Qwen2 in fp32), each transport pushes a full new version the way
the loop does: publish (trainer side) → pause (in_place) → load → version++ → resume (engine side),
plus, for `broadcast` and `p2p`, the sender's own completion. The time is from the start of publish until the
engine is resumed; afterwards a generate call checks that the engine serves the new version. The
engine runs with `verify_weights: false`: the checksum comparison is timed separately (column
"check"), since it costs a hash of every weight on both sides. The baseline is `dst.copy_(src)` of
the same number of bytes, preallocated, measured in the same run.

    python bench/weight_update.py                 # 4 MB, 63 MB and 500 MB models (~5 min here)
    python bench/weight_update.py --quick         # the 4 MB model only, one push per transport (CI)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import build_model, machine, median, model_bytes, table, timed  # noqa: E402

if TYPE_CHECKING:
    from miles_sync.copies import CopyCount

SIZES = {  # name: (hidden, layers)
    "4 MB": (128, 4),
    "63 MB": (512, 4),
    "500 MB": (1024, 8),
}
TRANSPORTS = ("disk", "tensor", "tensor-unpipelined", "broadcast", "p2p")
"""`tensor` with its default `sync.pipeline` (the engine loads bucket k while the sender copies bucket k+1), and
`tensor-unpipelined` without (every copy ends in publish)."""


def memcpy_seconds(num_bytes: int, repeats: int = 5) -> float:
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages once
    return median([timed(lambda: dst.copy_(src)) for _ in range(repeats)])


def push(engine, sender, weights, version: int) -> tuple[float, float, CopyCount]:
    """(seconds in publish, seconds from publish start to resumed engine, the copies counted meanwhile)."""
    from miles_rollout.push import land
    from miles_sync.copies import CopyCount

    with CopyCount() as copies:
        start = time.perf_counter()
        handle = sender.publish(weights, weight_version=version)
        published = time.perf_counter() - start
        land(engine, handle)  # pause (in_place) → load → resume, as the loop does
        sender.wait()
        end = time.perf_counter()
    return published, end - start, copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smallest model, one push per transport")
    parser.add_argument("--sizes", nargs="*", choices=list(SIZES), help="model sizes to run (default: all)")
    parser.add_argument("--transports", nargs="*", choices=TRANSPORTS, help="transports to run (default: all)")
    parser.add_argument("--repeats", type=int, default=3, help="pushes per transport and size (median)")
    parser.add_argument("--out", type=Path, help="also write the report here (Markdown)")
    args = parser.parse_args()

    import torch
    from safetensors.torch import load_file

    from miles_rollout import GenerateRequest, SamplingParams, build_engine
    from miles_rollout.config import SGLangEngineConfig
    from miles_sync import build_sender, needs_receiver_ranks, sync_config

    sizes = ["4 MB"] if args.quick else (args.sizes or list(SIZES))
    repeats = 1 if args.quick else args.repeats
    cache = Path(os.environ.get("MILES_CACHE", Path.home() / ".cache" / "miles")) / "bench"
    rows = []
    for size in sizes:
        hidden, layers = SIZES[size]
        model = build_model(cache / f"qwen2-h{hidden}-l{layers}", hidden=hidden, layers=layers)
        num_bytes = model_bytes(model)
        base = [(n, t) for f in sorted(model.glob("*.safetensors")) for n, t in load_file(str(f)).items()]
        copy_s = memcpy_seconds(num_bytes)
        config = SGLangEngineConfig(type="sglang", max_total_tokens=8192, verify_weights=False)
        engine = build_engine(config, model)
        workdir = Path(tempfile.mkdtemp(prefix="miles-bench-w-"))
        version = 0
        try:
            for transport in args.transports or TRANSPORTS:
                extra = {"disk": {"dir": str(workdir / transport)}, "tensor-unpipelined": {"pipeline": False}}
                config = sync_config(transport=transport.removesuffix("-unpipelined"), **extra.get(transport, {}))
                ranks = engine.receiver_ranks() if needs_receiver_ranks(config) else 1
                sender = build_sender(config, receiver_ranks=ranks)
                times, publish_times, copies = [], [], []
                for _ in range(repeats + 1):  # the first push is a warm-up
                    version += 1
                    weights = [(n, t + 0.001 * version) for n, t in base]
                    published, total, counted = push(engine, sender, weights, version)
                    times.append(total)
                    publish_times.append(published)
                    copies.append((counted.tensor_bytes / num_bytes, counted.io_bytes / num_bytes))
                check_s = timed(engine.weight_fingerprint)  # checksums on the server and here, compared
                served = asyncio.run(
                    engine.generate([GenerateRequest([3, 13, 4, 16], SamplingParams(max_new_tokens=2), "x")])
                )
                assert served[0].weight_versions == [version], "the engine must serve the version just pushed"
                sender.close()
                latency, publish_s = median(times[1:]), median(publish_times[1:])
                rows.append(
                    [
                        size,
                        transport,
                        num_bytes / 1e6,
                        latency * 1e3,
                        publish_s * 1e3,
                        check_s * 1e3,
                        copy_s * 1e3,
                        latency / copy_s,
                        median([memory for memory, _ in copies[1:]]),
                        median([io for _, io in copies[1:]]),
                    ]
                )
                print(
                    f"{size} {transport}: {latency * 1e3:.1f} ms (memcpy {copy_s * 1e3:.2f} ms), "
                    f"copies per byte {rows[-1][-2]:.2f} in memory, {rows[-1][-1]:.2f} through files or sockets",
                    flush=True,
                )
        finally:
            engine.shutdown()
            shutil.rmtree(workdir, ignore_errors=True)
        del base
        torch.cuda.empty_cache() if torch.cuda.is_available() else None

    report = "\n".join(
        [
            "# Weight-update latency per transport",
            "",
            f"Machine: {machine()}. Engine: one SGLang server, weights fp32 on the wire and in the engine. "
            f"Latency: publish → pause (in_place) → load → resume, median of {repeats} pushes after a warm-up. "
            "Per byte of the version, counted in this process (the trainer's sender and the engine's client; "
            "`miles_sync.copies`): memory copies are bytes written by torch operations in the pushing thread, file + "
            "socket bytes those written to files and sockets and read from files by system calls (a broadcast to "
            "the engine's own rank and a server writes each byte twice to sockets; what a socket receives is not "
            "counted). The SGLang server's own load is another process and not counted, nor is `tensor`'s copy into shared memory "
            "(pipelined: it runs in the sender's own thread; one more copy per byte than the column shows).",
            "",
            table(
                [
                    "model",
                    "transport",
                    "MB",
                    "latency ms",
                    "of which publish ms",
                    "check ms",
                    "memcpy ms",
                    "latency / memcpy",
                    "memory copies / byte",
                    "file + socket bytes / byte",
                ],
                rows,
            ),
            "",
        ]
    )
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
