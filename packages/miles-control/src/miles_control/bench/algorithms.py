"""`miles bench algorithms`: the same workload under each objective (`train.algorithm`), side by side.

Each algorithm is a variant of one `sweep` (`miles_control.bench.sweep`): its own job (same spec, same seed, the same
number of steps) into one SQLite store under the output folder. Per algorithm, from the recorded metrics and spans
only (`miles_control.service.summary`):

- held-out accuracy at every evaluation, against step and against wall time since the first step;
- mean rollout reward of the first and the last five steps;
- step time (wall time / steps) and the share of it spent training;
- tokens generated per token trained: every token the rollout generated (with dynamic sampling, the dropped and
  the aborted groups' too) over the response tokens the trainer trained on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from miles_control.bench.sweep import VariantRun, plot_by_variant, sweep
from miles_control.service.store import Store
from miles_control.service.summary import RunSummary
from miles_control.spec.config import JobSpec
from miles_train.config import RL_ALGORITHMS


@dataclass
class AlgorithmResult:
    """One algorithm's job: its summary, the tokens its rollouts generated and when each step ended."""

    name: str
    summary: RunSummary
    generated_tokens: float
    step_end: dict[int, float]  # seconds from the first step's start to each step's end

    @property
    def step_s(self) -> float:
        """Wall time per step."""
        return self.summary.wall_s / self.summary.num_steps if self.summary.num_steps else 0.0

    @property
    def train_share(self) -> float:
        """The share of the wall time spent training."""
        return self.summary.stage_s.get("train", 0.0) / self.summary.wall_s if self.summary.wall_s else 0.0

    @property
    def accuracy_by_wall(self) -> list[tuple[float, float]]:
        """(seconds since the first step, held-out accuracy) of each evaluation after step 0 (step 0: at 0 s)."""
        return [(0.0 if step == 0 else self.step_end.get(step, 0.0), acc) for step, acc in self.summary.eval_accuracy]

    @property
    def generated_per_trained(self) -> float:
        """Tokens generated per response token trained on."""
        return self.generated_tokens / self.summary.tokens if self.summary.tokens else 0.0

    def reward_mean(self, last: bool) -> float:
        """Mean rollout reward of the first (or the last) five steps."""
        values = [v for _, v in self.summary.reward_by_step]
        part = values[-5:] if last else values[:5]
        return sum(part) / len(part) if part else float("nan")


def algorithm_result(store: Store, name: str, summary: RunSummary) -> AlgorithmResult:
    """The measures of the job `summary` summarizes, from what it recorded in `store`."""
    job_id = summary.job_id
    generated = sum(sp.num_tokens for sp in store.spans(job_id, "rollout") if sp.step >= 1)
    steps = [s for s in store.steps(job_id) if s.ended_at is not None]
    step_end = {s.step: s.ended_at - steps[0].started_at for s in steps}
    return AlgorithmResult(name, summary, float(generated), step_end)


def run_algorithms(
    base: JobSpec,
    out: Path,
    names: tuple[str, ...] = RL_ALGORITHMS,
    on_job=lambda name, job_id: None,
    store_url: str | None = None,
) -> list[AlgorithmResult]:
    """Run `base` once per algorithm into `store_url` (default `out/bench.db`); an algorithm's job that fails stops
    the bench."""
    results = []

    def measure(store: Store, run: VariantRun) -> None:
        assert run.summary is not None  # without checks, every variant runs
        on_job(run.name, run.job_id)
        results.append(algorithm_result(store, run.name, run.summary))

    sweep(base, {name: {"train.algorithm.name": name} for name in names}, out, store_url, on_run=measure)
    return results


def plot(results: list[AlgorithmResult], out: Path) -> list[str]:
    """Write the accuracy and reward plots into `out`; returns their file names."""
    wall = "wall time since the first step (s)"
    return [
        plot_by_variant(out / name, {r.name: points(r) for r in results}, xlabel, ylabel)
        for name, xlabel, ylabel, points in (
            ("accuracy_vs_step.png", "step", "held-out accuracy", lambda r: r.summary.eval_accuracy),
            ("accuracy_vs_wall.png", wall, "held-out accuracy", lambda r: r.accuracy_by_wall),
            ("reward_vs_step.png", "step", "mean rollout reward", lambda r: r.summary.reward_by_step),
        )
    ]


def report(results: list[AlgorithmResult], spec: JobSpec, machine: str, out: Path) -> str:
    """Write `out/report.md` (and its plots) comparing the algorithms; returns its markdown."""
    plots = plot(results, out)

    def cell(value) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = [
        "# Algorithm comparison",
        "",
        f"Machine: {machine}. Spec `{spec.name}`: engine `{spec.rollout.engine.type}`, backend "
        f"`{spec.train.backend.type}`, {spec.rollout.num_prompts_per_step} prompts × "
        f"{spec.rollout.num_samples_per_prompt} samples per step, {spec.schedule.num_steps} steps, schedule "
        f"`{spec.schedule.type}`, seed {spec.seed}"
        + (", dynamic sampling on" if spec.rollout.dynamic_sampling else "")
        + ". Every algorithm starts from the same checkpoint and sees the same prompts.",
        "",
        "| algorithm | status | steps | held-out accuracy first → last (best) | reward first 5 → last 5 steps | "
        "step s | train share | tokens generated / trained |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        acc = [a for _, a in r.summary.eval_accuracy]
        cells = [
            r.name,
            r.summary.status,
            r.summary.num_steps,
            f"{acc[0]:.3f} → {acc[-1]:.3f} ({max(acc):.3f})" if acc else "–",
            f"{r.reward_mean(False):.3f} → {r.reward_mean(True):.3f}",
            r.step_s,
            r.train_share,
            r.generated_per_trained,
        ]
        lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    evals = sorted({step for r in results for step, _ in r.summary.eval_accuracy})
    lines += ["", "Held-out accuracy at each evaluation:", ""]
    lines += ["| algorithm | " + " | ".join(f"step {s}" for s in evals) + " |", "|---|" + "---|" * len(evals)]
    for r in results:
        by_step = dict(r.summary.eval_accuracy)
        lines.append("| " + " | ".join([r.name, *[cell(by_step.get(s, float("nan"))) for s in evals]]) + " |")
    lines += ["", *[f"![{p}]({p})" for p in plots], "", f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')}.", ""]
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text
