"""`miles bench precision`: the same workload under each precision recipe, side by side.

A recipe is a few overrides of the job spec: the trainer's compute precision (`train.precision`), the format the
pushes quantize the engines' weights to (`sync.quantization`), and whether the trainer fake-quantizes to the same
format (`train.quantization`, the recipe that matches training to the rollout). Each recipe is a variant of one
`sweep` (`miles_control.bench.sweep`): its own job (same spec, same seed) into one SQLite store under the output folder;
a recipe the job checks refuse (a format whose blocks do not fit the model) is reported with the reason instead of
a row of numbers.

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

from miles_control.bench.sweep import VariantRun, plot_by_variant, sweep
from miles_control.service.store import Store
from miles_control.service.summary import RunSummary
from miles_control.spec.config import JobSpec

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
    """One recipe: its job's summary and measures, or why the job checks refused it."""

    name: str
    overrides: dict[str, Any]
    refused: str | None = None
    summary: RunSummary | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    packed_bytes: int = 0


def recipe_overrides(base: JobSpec, name: str) -> dict[str, Any]:
    """The recipe's fields, "same as sync" replaced by `base`'s value of that sync field."""
    sync = base.sync.model_dump(mode="json")
    return {
        path: sync[path.rsplit(".", 1)[1]] if value == SAME_AS_SYNC else value for path, value in RECIPES[name].items()
    }


def packed_push_bytes(model_path: Path, spec: JobSpec) -> int:
    """Bytes of one push of the checkpoint with its linear weights packed in `sync.quantization`, the rest in the
    engines' dtype (2 bytes for bf16/fp16, 4 for fp32)."""
    from miles_control.bench.inprocess import checkpoint_weights
    from miles_rollout.engines.checkpoint import engine_dtype
    from miles_sync.formats import packed_bytes

    itemsize = 4 if engine_dtype(spec.rollout.engine.dtype, model_path) == "float32" else 2
    return packed_bytes(checkpoint_weights(model_path), spec.sync.quantization, spec.sync.quant_group_size, itemsize)


def recipe_result(store: Store, name: str, summary: RunSummary, spec: JobSpec, model_path: Path) -> RecipeResult:
    """The measures of the recipe's job (`summary`'s), from what it recorded in `store` and the spec it ran."""
    result = RecipeResult(name, RECIPES[name], summary=summary, packed_bytes=packed_push_bytes(model_path, spec))
    for key in ("train/logprob_diff", "train/logprob_diff_p99", "train/mismatch_k3", "sync/bytes"):
        series = [v for step, v in store.metric_series(summary.job_id, key) if step >= 1]
        result.metrics[key] = statistics.fmean(series) if series else float("nan")
    return result


def run_recipes(
    base: JobSpec,
    out: Path,
    names: tuple[str, ...] = tuple(RECIPES),
    on_job=lambda name, result: None,
    store_url: str | None = None,
) -> list[RecipeResult]:
    """Run `base` once per recipe into `store_url` (default `out/bench.db`); a recipe the job checks refuse is kept
    with the reason."""
    from miles_control.job.assets import resolve_model_path
    from miles_control.job.preflight import check_job

    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise ValueError(f"unknown recipe(s) {', '.join(unknown)}; choose from: {', '.join(RECIPES)}")
    model_path = resolve_model_path(base)
    results = []

    def measure(store: Store, run: VariantRun) -> None:
        if run.summary is None or run.spec is None:
            result = RecipeResult(run.name, RECIPES[run.name], refused=run.refused)
        else:
            result = recipe_result(store, run.name, run.summary, run.spec, model_path)
        results.append(result)
        on_job(run.name, result)

    sweep(
        base,
        {name: recipe_overrides(base, name) for name in names},
        out,
        store_url,
        job_name=lambda index, name: f"{base.name}-precision-{index}",
        check=lambda spec: check_job(spec, model_path),
        on_run=measure,
    )
    return results


def plot(results: list[RecipeResult], out: Path) -> list[str]:
    """Write the mismatch and reward plots into `out`; returns their file names."""
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
    rewards = {r.name: r.summary.reward_by_step for r in results if r.summary is not None}
    reward_plot = plot_by_variant(out / "reward_vs_step.png", rewards, "step", "mean rollout reward", (8, 4.5), 7)
    return ["mismatch.png", reward_plot]


def report(results: list[RecipeResult], spec: JobSpec, machine: str, out: Path) -> str:
    """Write `out/report.md` (and its plots) comparing the recipes; returns its markdown."""
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
