"""Trainer tokens/s of each backend against a plain PyTorch loop, same model, same batch.

The plain loop is the GRPO step written directly on an unsharded HF model in one process (forward,
clipped-ratio loss, backward, gradient clipping at 1.0, AdamW) — what a backend would be without
any framework. Each backend runs the same step through `build_backend(...).train_step`, in its own
processes (gloo on CPU, NCCL on GPU). Every layout gets the same cores: one process with all threads,
or two ranks with half the threads each. tokens/s = tokens in the batch / median step time after
warm-up; the ratio is against the plain loop measured in the same run (goal: fsdp2 ≥ 0.9).

    python bench/trainer_throughput.py            # hidden 512, 4 layers, 32 × 96 tokens, 6 timed steps
    python bench/trainer_throughput.py --quick    # a 1-layer model (4 heads, so TP=2 fits), 2 timed steps (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import build_model, machine, median, table  # noqa: E402

# name: (variant, ranks); the variant's backend config is in `backend_config`
LAYOUTS = {
    "fsdp2": ("fsdp2", 1),
    "megatron": ("megatron", 1),
    "torchtitan": ("torchtitan", 1),
    "fsdp2 ×2 ranks": ("fsdp2", 2),
    "megatron TP=2": ("megatron-tp2", 2),
    "torchtitan TP=2": ("torchtitan-tp2", 2),
}


def backend_config(variant: str, world_size: int) -> dict:
    kind, _, option = variant.partition("-")
    if kind == "fsdp2":
        return {"type": "fsdp2", "world_size": world_size}
    return {"type": kind, "world_size": world_size, "tensor_parallel_size": 2 if option == "tp2" else 1}


def make_batch(rows: int, prompt_len: int, response_len: int, vocab: int):
    """A fixed batch (seeded) of equal-length rows in groups of 8, random tokens and rewards."""
    import torch

    from miles_train.types import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (rows, prompt_len + response_len), generator=g).tolist()
    return TrainBatch(
        input_ids=ids,
        response_start=[prompt_len] * rows,
        rollout_logprobs=[[-2.5] * response_len for _ in range(rows)],
        loss_mask=[[1] * response_len for _ in range(rows)],
        rewards=torch.randint(0, 2, (rows,), generator=g).float().tolist(),
        group_index=[i // 8 for i in range(rows)],
    )


def plain_loop(model_dir: str, batch, steps: int) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    from miles_train.collate import collate, token_logprobs
    from miles_train.loss import aggregate, ppo_clip
    from miles_train.objectives import group_baseline_advantages

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        c = collate(batch)
        adv = group_baseline_advantages(batch.rewards, batch.group_index, "std").float()
        logprobs, _ = token_logprobs(model, c, with_entropy=True)
        ratio = torch.exp(logprobs - c.rollout_logprobs)
        pg, _ = ppo_clip(ratio, adv[:, None].expand_as(logprobs), 0.2, 0.2)
        aggregate(pg, c.loss_mask, "token_mean", float(c.loss_mask.sum()), len(batch)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def worker(args: argparse.Namespace) -> None:
    """One process of one layout: time `steps` training steps, rank 0 writes them to `out`."""
    import torch

    torch.set_num_threads(args.threads)
    batch = make_batch(args.rows, args.prompt_len, args.response_len, args.vocab)
    if args.variant == "plain":
        times = plain_loop(args.model, batch, args.steps)
    else:
        from miles_train import TrainConfig, build_backend

        config = TrainConfig.model_validate(
            {
                "backend": backend_config(args.variant, args.world_size),
                "optimizer": {"lr": 1e-5, "max_grad_norm": 1.0},
            }
        )
        backend = build_backend(config, args.model, args.rank, args.world_size, f"tcp://127.0.0.1:{args.port}")
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            backend.train_step(batch)
            times.append(time.perf_counter() - start)
        backend.shutdown()
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(times))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(variant: str, ranks: int, common: list[str], threads: int, workdir: Path) -> list[float]:
    out, port = workdir / f"{variant}-{ranks}.json", free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", "--variant", variant, "--rank", str(r), "--world-size", str(ranks)]
            + ["--port", str(port), "--out", str(out), "--threads", str(max(1, threads // ranks))]
            + common,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(ranks)
    ]
    logs = [p.communicate(timeout=1800)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        if p.returncode:
            raise RuntimeError(f"{variant} on {ranks} ranks failed:\n{log[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 timed steps (a smoke run)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--response-len", type=int, default=80)
    parser.add_argument("--steps", type=int, default=6, help="timed steps (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--out", type=Path, help="also write the report here")
    # worker mode (internal)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name, kind in (("variant", str), ("rank", int), ("world-size", int), ("port", int), ("threads", int)):
        parser.add_argument(f"--{name}", type=kind, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.hidden, args.layers, args.rows, args.response_len, args.steps, args.warmup = 256, 1, 8, 16, 2, 1

    cache = Path(os.environ.get("MILES_CACHE", Path.home() / ".cache" / "miles")) / "bench"
    model_dir = build_model(cache / f"qwen2-h{args.hidden}-l{args.layers}", args.hidden, args.layers)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    threads = os.cpu_count() or 1
    common = ["--model", str(model_dir), "--vocab", str(vocab), "--rows", str(args.rows)]
    common += ["--prompt-len", str(args.prompt_len), "--response-len", str(args.response_len)]
    common += ["--steps", str(args.steps + args.warmup)]
    tokens = args.rows * (args.prompt_len + args.response_len)
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ["plain PyTorch loop", *args.layouts]:
            variant, ranks = ("plain", 1) if name == "plain PyTorch loop" else LAYOUTS[name]
            times = run_layout(variant, ranks, common, threads, Path(tmp))[args.warmup :]
            results[name] = median(times)
            print(f"{name}: {tokens / results[name]:,.0f} tokens/s", file=sys.stderr)
    base = results["plain PyTorch loop"]
    rows = [
        [
            name,
            LAYOUTS[name][1] if name in LAYOUTS else 1,
            results[name] * 1000,
            tokens / results[name],
            base / results[name],
        ]
        for name in results
    ]
    report = "\n".join(
        [
            "# Trainer throughput: backends vs a plain PyTorch loop",
            "",
            f"Machine: {machine()}. Model: random Qwen2, hidden {args.hidden}, {args.layers} layers, fp32. "
            f"Batch: {args.rows} rows × {args.prompt_len + args.response_len} tokens ({tokens:,} tokens), "
            f"GRPO step with clipping at 1.0 and AdamW; median of {args.steps} steps after {args.warmup} warm-up.",
            "",
            table(["trainer", "ranks", "step (ms)", "tokens/s", "ratio to plain loop"], rows),
            "",
            f"fsdp2 / plain loop: **{base / results['fsdp2']:.2f}** (goal ≥ 0.9)" if "fsdp2" in results else "",
        ]
    )
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
