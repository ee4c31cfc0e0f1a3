"""`miles bench precision`: the same workload under each precision recipe, side by side.

A recipe is a few overrides of the job spec: the trainer's compute precision (`train.precision`), the format the
pushes quantize the engines' weights to (`sync.quantization`), and whether the trainer fake-quantizes to the same
format (`train.quantization`, the recipe that matches training to the rollout). Each runs as its own job (same
spec, same seed) into one SQLite store under the output folder; a recipe the job checks refuse (a format whose
blocks do not fit the model) is reported with the reason instead of a row of numbers.

Per recipe, from the recorded metrics and spans only:

- rollout-vs-trainer mismatch: mean and p99 |Δ logprob| per token, and the k3 estimate of KL(engine ‖ trainer),
  averaged over the steps (with one minibatch, the trainer's forward runs before its update: the same policy
  version);
- bytes per push: what travelled (on CPU the engines receive the dequantized values, in the wire dtype) and what a
  push of packed low-precision data with its scales carries (the GPU path's payload, computed from the checkpoint);
- push latency (the weight_sync span), step time (wall / steps), the reward of the last step, and held-out
  accuracy at the first and the last evaluation (the first one is taken under the recipe's rollout weights).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_control.config import JobSpec
from miles_control.reports import bench_url
from miles_control.store import Store
from miles_control.summary import RunSummary, summarize

FORMATS = ("fp8", "fp8_block", "mxfp8", "nvfp4", "int4")
SAME_AS_SYNC = "same as sync"  # a matching recipe quantizes on the engines' grid, whatever the base spec's


def _recipes() -> dict[str, dict[str, Any]]:
    recipes: dict[str, dict[str, Any]] = {
        "fp32": {},
        "bf16": {"train.precision": "bf16"},
        "fp16": {"train.precision": "fp16"},
    }
    for fmt in FORMATS:
        recipes[f"{fmt} rollout"] = {"sync.quantization": fmt}
        recipes[f"{fmt} rollout + {fmt} training"] = {
            "sync.quantization": fmt,
            "train.quantization": fmt,
            "train.quant_group_size": SAME_AS_SYNC,
        }
    return recipes


RECIPES = _recipes()
QUICK = ("fp32", "bf16", "int4 rollout", "int4 rollout + int4 training")


@dataclass
class RecipeResult:
    name: str
    overrides: dict[str, Any]
    refused: str | None = None
    summary: RunSummary | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    packed_bytes: int = 0


def with_overrides(base: JobSpec, overrides: dict[str, Any], **top: Any) -> JobSpec:
    """`base` with dotted-path fields replaced (and top-level sections merged from `top`)."""
    data = base.model_dump(mode="json")
    for path, value in overrides.items():
        if value == SAME_AS_SYNC:
            value = data["sync"][path.rsplit(".", 1)[1]]
        *parents, leaf = path.split(".")
        node = data
        for key in parents:
            node = node[key]
        node[leaf] = value
    for key, value in top.items():
        data[key] = value if not isinstance(value, dict) else {**data.get(key, {}), **value}
    return JobSpec.model_validate(data)


def packed_push_bytes(model_path: Path, spec: JobSpec) -> int:
    """Bytes of one push of the checkpoint with its linear weights packed in `sync.quantization`, the rest in the
    engines' dtype (2 bytes for bf16/fp16, 4 for fp32)."""
    from miles_control.inprocess import checkpoint_weights
    from miles_rollout.engines.checkpoint import engine_dtype
    from miles_sync.formats import packed_bytes

    itemsize = 4 if engine_dtype(spec.rollout.engine.dtype, model_path) == "float32" else 2
    return packed_bytes(checkpoint_weights(model_path), spec.sync.quantization, spec.sync.quant_group_size, itemsize)


def run_recipes(
    base: JobSpec,
    out: Path,
    names: tuple[str, ...] = tuple(RECIPES),
    on_job=lambda name, result: None,
    store_url: str | None = None,
) -> list[RecipeResult]:
    """Run `base` once per recipe into `store_url` (default `out/bench.db`)."""
    from miles_control.assets import resolve_model_path
    from miles_control.preflight import JobCheckError, check_job
    from miles_control.run import run_job

    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise ValueError(f"unknown recipe(s) {', '.join(unknown)}; choose from: {', '.join(RECIPES)}")
    out.mkdir(parents=True, exist_ok=True)
    url = store_url or bench_url(out)
    store = Store(url)
    model_path = resolve_model_path(base)
    results = []
    for name in names:
        overrides = RECIPES[name]
        result = RecipeResult(name, overrides)
        try:
            spec = with_overrides(base, overrides, store={"url": url})
            spec = spec.model_copy(update={"name": f"{base.name}-precision-{len(results)}"})
            check_job(spec, model_path)
        except (ValueError, JobCheckError) as exc:
            result.refused = str(exc).splitlines()[0]
            results.append(result)
            on_job(name, result)
            continue
        data = spec.model_dump(mode="json")
        data["schedule"]["stop_at_accuracy"] = None  # the same number of steps for every recipe
        spec = JobSpec.model_validate(data)
        job_id = run_job(spec, store=store)
        result.summary = summarize(store, job_id)
        if not result.summary.num_steps:
            raise RuntimeError(f"job {job_id} ({name}) recorded no steps: {store.job(job_id).error}")
        for key in ("train/logprob_diff", "train/logprob_diff_p99", "train/mismatch_k3", "sync/bytes"):
            series = [v for step, v in store.metric_series(job_id, key) if step >= 1]
            result.metrics[key] = statistics.fmean(series) if series else float("nan")
        result.packed_bytes = packed_push_bytes(model_path, spec)
        results.append(result)
        on_job(name, result)
    return results


def plot(results: list[RecipeResult], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in results if r.summary is not None]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.barh([r.name for r in ran], [r.metrics["train/logprob_diff"] for r in ran], label="mean")
    ax.barh([r.name for r in ran], [r.metrics["train/logprob_diff_p99"] for r in ran], alpha=0.35, label="p99")
    ax.set_xscale("log")
    ax.set_xlabel("|trainer − engine| logprob per token")
    ax.invert_yaxis()
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "mismatch.png")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for r in ran:
        assert r.summary is not None
        points = r.summary.reward_by_step
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=r.name)
    ax.set_xlabel("step")
    ax.set_ylabel("mean rollout reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "reward_vs_step.png")
    plt.close(fig)
    return ["mismatch.png", "reward_vs_step.png"]


def report(results: list[RecipeResult], spec: JobSpec, machine: str, out: Path) -> str:
    plots = plot(results, out)
    lines = [
        "# Precision recipes",
        "",
        f"{machine}. Spec `{spec.name}`: engine `{spec.rollout.engine.type}`, backend `{spec.train.backend.type}`, "
        f"{spec.rollout.num_prompts_per_step} prompts × {spec.rollout.num_samples_per_prompt} samples per step, "
        f"{spec.schedule.num_steps} steps, schedule `{spec.schedule.type}`, transport `{spec.sync.transport}`. "
        "Quantized rollout on CPU is weight-only emulation: the engines receive the dequantized values of the "
        "format's grid, so *bytes sent* is the wire dtype's size and *bytes packed* is what the format itself "
        "carries (data + scales).",
        "",
        "| recipe | mean \\|Δ logprob\\| | p99 \\|Δ logprob\\| | k3 KL | bytes sent / push | bytes packed / push "
        "| push s | step s | last reward | held-out accuracy, start → end |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.summary is None:
            lines.append(f"| {r.name} | refused: {r.refused} | | | | | | | | |")
            continue
        s, m = r.summary, r.metrics
        push = statistics.fmean(s.weight_sync_s) if s.weight_sync_s else float("nan")
        reward = s.reward_by_step[-1][1] if s.reward_by_step else float("nan")
        accuracy = f"{s.eval_accuracy[0][1]:.3f} → {s.eval_accuracy[-1][1]:.3f}" if s.eval_accuracy else "-"
        lines.append(
            f"| {r.name} | {m['train/logprob_diff']:.2e} | {m['train/logprob_diff_p99']:.2e} | "
            f"{m['train/mismatch_k3']:.2e} | {m['sync/bytes']:,.0f} | {r.packed_bytes:,} | {push:.3f} | "
            f"{s.wall_s / max(s.num_steps, 1):.2f} | {reward:.3f} | {accuracy} |"
        )
    lines += ["", *[f"![{p}]({p})" for p in plots], ""]
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text
