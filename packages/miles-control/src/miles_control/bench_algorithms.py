"""`miles bench algorithms`: the same workload under each objective (`train.algorithm`), side by side.

Each algorithm runs as its own job (same spec, same seed, the same number of steps) into one SQLite store under the
output folder. Per algorithm, from the recorded metrics and spans only (`miles_control.summary`):

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

from miles_control.config import JobSpec
from miles_control.reports import bench_url
from miles_control.store import Store
from miles_control.summary import RunSummary, summarize
from miles_train.config import RL_ALGORITHMS


@dataclass
class AlgorithmResult:
    name: str
    summary: RunSummary
    generated_tokens: float
    step_end: dict[int, float]  # seconds from the first step's start to each step's end

    @property
    def step_s(self) -> float:
        return self.summary.wall_s / self.summary.num_steps if self.summary.num_steps else 0.0

    @property
    def accuracy_by_wall(self) -> list[tuple[float, float]]:
        """(seconds since the first step, held-out accuracy) of each evaluation after step 0 (step 0: at 0 s)."""
        return [(0.0 if step == 0 else self.step_end.get(step, 0.0), acc) for step, acc in self.summary.eval_accuracy]

    @property
    def generated_per_trained(self) -> float:
        return self.generated_tokens / self.summary.tokens if self.summary.tokens else 0.0

    def reward_mean(self, last: bool) -> float:
        values = [v for _, v in self.summary.reward_by_step]
        part = values[-5:] if last else values[:5]
        return sum(part) / len(part) if part else float("nan")


def run_algorithms(
    base: JobSpec,
    out: Path,
    names: tuple[str, ...] = RL_ALGORITHMS,
    on_job=lambda name, job_id: None,
    store_url: str | None = None,
) -> list[AlgorithmResult]:
    """Run `base` once per algorithm into `store_url` (default `out/bench.db`); an algorithm's job that fails stops
    the bench."""
    from miles_control.run import run_job

    out.mkdir(parents=True, exist_ok=True)
    url = store_url or bench_url(out)
    store = Store(url)
    results = []
    for name in names:
        data = base.model_dump(mode="json")
        data["name"] = f"{base.name}-bench-{name.replace(':', '-')}"
        data["train"]["algorithm"] = {**data["train"]["algorithm"], "name": name}
        data["schedule"]["stop_at_accuracy"] = None  # the same number of steps for every algorithm
        data["store"]["url"] = url
        job_id = run_job(JobSpec.model_validate(data), store=store)
        on_job(name, job_id)
        summary = summarize(store, job_id)
        if not summary.num_steps:
            raise RuntimeError(f"job {job_id} ({name}) recorded no steps: {store.job(job_id).error}")
        generated = sum(sp.num_tokens for sp in store.spans(job_id, "rollout") if sp.step >= 1)
        steps = [s for s in store.steps(job_id) if s.ended_at is not None]
        step_end = {s.step: s.ended_at - steps[0].started_at for s in steps}
        results.append(AlgorithmResult(name, summary, float(generated), step_end))
    return results


def plot(results: list[AlgorithmResult], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for name, xlabel, points in (
        ("accuracy_vs_step.png", "step", lambda r: r.summary.eval_accuracy),
        ("accuracy_vs_wall.png", "wall time since the first step (s)", lambda r: r.accuracy_by_wall),
        ("reward_vs_step.png", "step", lambda r: r.summary.reward_by_step),
    ):
        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        for r in results:
            xs, ys = zip(*points(r), strict=True) if points(r) else ((), ())
            ax.plot(xs, ys, marker=".", label=r.name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean rollout reward" if name.startswith("reward") else "held-out accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name)
        plt.close(fig)
        files.append(name)
    return files


def report(results: list[AlgorithmResult], spec: JobSpec, machine: str, out: Path) -> str:
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
        train_share = r.summary.stage_s.get("train", 0.0) / r.summary.wall_s if r.summary.wall_s else 0.0
        cells = [
            r.name,
            r.summary.status,
            r.summary.num_steps,
            f"{acc[0]:.3f} → {acc[-1]:.3f} ({max(acc):.3f})" if acc else "–",
            f"{r.reward_mean(False):.3f} → {r.reward_mean(True):.3f}",
            r.step_s,
            train_share,
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
