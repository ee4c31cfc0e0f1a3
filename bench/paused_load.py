"""What a weight load costs an SGLang server that is paused with requests in flight, against an idle one, and
whether the server's processes having a core to themselves changes it (issue 43, item 3).

One SGLang server (CPU recipe) on a random model of the demo's size; the `disk` transport. The server starts
as `ray.cpu_split` starts it on a 2-core machine: this process is pinned to the last core first, so the server
inherits that core and one OpenMP thread (`OMP_NUM_THREADS` follows the affinity). Each scenario pushes
`--pushes` versions and reports the median of the engine's push phases (`pause/servers`, `load/servers`,
`load/verify`, ms):

- idle: nothing in flight (what a push under `sync` sees);
- paused with requests in flight: a batch of requests decoding, paused `in_place` for the push;
- paused, nothing in flight: the idle server paused `in_place` by hand before the load (SGLang's scheduler spins
  while paused, with or without requests), which separates the paused state from the requests it holds;
- two cores: a second server started with both cores (two OpenMP threads), paused with requests in flight.

    .venv/bin/python bench/paused_load.py [--pushes 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
from common import build_model

PHASES = ("pause/servers", "load/servers", "load/verify")


def post_each(engine, path: str, body: dict | None = None) -> None:
    """POST `path` to every server of the engine (a pause or resume the engine itself would not send)."""
    for slot in engine.slots:
        httpx.post(slot.url + path, json=body or {}, timeout=60).raise_for_status()


def push_once(engine, sender, params, version: int, busy: bool | str) -> dict[str, float]:
    """One push; `busy` True: requests decoding while it is paused; "empty": paused by hand with none in flight."""
    from miles_rollout import GenerateRequest, SamplingParams
    from miles_rollout.push import land

    done = threading.Event()

    def generate() -> None:
        sampling = SamplingParams(max_new_tokens=200, ignore_eos=True, temperature=1.0)
        requests = [GenerateRequest([3 + i % 10, 13, 4 + i % 7, 16], sampling, f"v{version}-{i}") for i in range(256)]
        asyncio.run(engine.generate(requests))
        done.set()

    if busy is True:
        threading.Thread(target=generate, daemon=True).start()
        deadline = time.time() + 30
        while not any(s.outstanding for s in engine.slots) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # decoding is under way
    if busy == "empty":
        post_each(engine, "/pause_generation", {"mode": "in_place"})
    handle = sender.publish([(n, p + version * 1e-3) for n, p in params], version)
    try:
        phases = land(engine, handle).phases  # pause (in_place) → load → resume, the engine's phases inside
    finally:
        if busy == "empty":
            post_each(engine, "/continue_generation")
    if busy is True:
        done.wait(120)
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pushes", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from miles_rollout import build_engine
    from miles_rollout.config import SGLangEngineConfig
    from miles_sync import DiskSync, build_sender

    work = Path(tempfile.mkdtemp(prefix="miles-paused-load-"))
    model_dir = build_model(work / "model", hidden=128, layers=4)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    sender = build_sender(DiskSync(dir=str(work / "weights")))
    cores = os.sched_getaffinity(0)
    rollout_core = {max(cores)}
    rows, version = [], 0
    try:
        for server_cores, scenarios in (
            (
                rollout_core,
                (
                    ("idle (as under sync)", False),
                    ("paused with requests in flight", True),
                    ("paused, nothing in flight", "empty"),
                ),
            ),
            (cores, (("paused with requests in flight", True),)),
        ):
            os.sched_setaffinity(0, server_cores)  # the server inherits it, its OpenMP threads follow
            engine = build_engine(SGLangEngineConfig(type="sglang", num_engines=1), model_dir, seed=0)
            try:
                for name, busy in scenarios:
                    measured = []
                    for _ in range(args.pushes):
                        version += 1
                        measured.append(push_once(engine, sender, params, version, busy))
                    medians = [statistics.median(m.get(p, 0.0) for m in measured) * 1000 for p in PHASES]
                    cells = " | ".join(f"{v:.1f}" for v in medians)
                    rows.append(f"| {name} | {len(server_cores)} | {cells} |")
            finally:
                engine.shutdown()
    finally:
        sender.close()
    text = "\n".join(
        [
            "| scenario | server cores | pause/servers ms | load/servers ms | load/verify ms |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"Median of {args.pushes} pushes each; {os.cpu_count()} CPU cores; this process shares the server's cores.",
        ]
    )
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
