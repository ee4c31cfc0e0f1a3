"""Shared helpers of the benchmarks: random-weight models of a chosen size, timing, Markdown tables."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path


def build_model(folder: Path, hidden: int, layers: int, intermediate: int | None = None, seed: int = 0) -> Path:
    """A random Qwen2 with the arithmetic character tokenizer, saved (once) as an HF folder in fp32."""
    from miles_control.testing.tiny_models import save_tiny_model, tiny_model
    from miles_rollout.tasks.arithmetic import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    heads = max(1, hidden // 64)
    config = tiny_model(
        "qwen2", tokenizer=tokenizer, hidden_size=hidden, intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=2048,
    )  # fmt: skip
    return save_tiny_model(folder, config, tokenizer=tokenizer, seed=seed)


def model_bytes(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                numel = 1
                for d in t.get_shape():
                    numel *= d
                total += numel * {"F32": 4, "BF16": 2, "F16": 2, "I64": 8}[t.get_dtype()]
    return total


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    return statistics.median(values)


def table(header: list[str], rows: list[list[object]]) -> str:
    def fmt(value: object) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> str:
    import os
    import platform

    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {gpu}, torch {torch.__version__}"
