"""`miles bench schedules`: the same workload under sync, one_step_off and fully_async, side by side.

Each schedule is a variant of one `sweep` (`miles_control.bench.sweep`): its own job (same spec, same seed,
`ray.cpu_split` so that rollout and training have their own cores) into one SQLite store under the output
folder. The report is computed from the recorded spans and metrics only, by `miles_control.service.summary` (the
summary `miles run` prints and the dashboard shows):

- throughput: trained samples/s and tokens/s over the loop's wall time (first step start → last end);
- time per stage: summed span durations;
- busy and idle share per component: the union of the rollout actor's spans (rollout, reward, eval)
  and of the trainer's (train, weight_sync) against wall time;
- the ideal overlap bound: with perfect overlap a step costs its slowest component, so the loop
  cannot beat `num_steps × max(rollout busy, trainer busy) / num_steps`; the report gives achieved
  throughput / that bound;
- reward against wall time and against step (PNG plots and a table).
"""

from __future__ import annotations

import time
from pathlib import Path

from miles_control.bench.sweep import plot_by_variant, sweep
from miles_control.service.summary import RunSummary, time_to_accuracy
from miles_control.spec.config import SCHEDULES, FullyAsyncSchedule, JobSpec, as_schedule

SCHEDULE_TYPES = tuple(SCHEDULES)


def run_schedules(
    base: JobSpec, out: Path, on_job=lambda schedule, job_id: None, store_url: str | None = None
) -> list[RunSummary]:
    """Run `base` once per schedule type into `store_url` (default `out/bench.db`); one summary per schedule."""
    variants = {
        schedule: {"schedule": as_schedule(base.schedule, schedule).model_dump(mode="json"), "ray.cpu_split": True}
        for schedule in SCHEDULE_TYPES
    }
    runs = sweep(base, variants, out, store_url, on_run=lambda store, run: on_job(run.name, run.job_id))
    return [run.summary for run in runs if run.summary is not None]  # without checks, every variant runs


def plot(summaries: list[RunSummary], out: Path) -> list[str]:
    """Write the reward, accuracy and time-breakdown plots into `out`; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wall = "wall time since the first step (s)"
    files = [
        plot_by_variant(out / name, {s.schedule: getattr(s, key) for s in summaries}, xlabel, ylabel)
        for name, key, xlabel, ylabel in (
            ("reward_vs_wall.png", "reward_by_wall", wall, "mean rollout reward"),
            ("reward_vs_step.png", "reward_by_step", "step", "mean rollout reward"),
            ("accuracy_vs_wall.png", "accuracy_by_wall", wall, "held-out accuracy"),
        )
    ]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    names = [s.schedule for s in summaries]
    ax.bar(names, [s.rollout_busy_s for s in summaries], width=0.35, align="edge", label="rollout busy")
    ax.bar(names, [s.trainer_busy_s for s in summaries], width=-0.35, align="edge", label="trainer busy")
    ax.plot(names, [s.wall_s for s in summaries], "k_", markersize=40, label="wall time")
    ax.set_ylabel("seconds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "time_breakdown.png")
    plt.close(fig)
    files.append("time_breakdown.png")
    return files


PUSH_COLUMNS = (
    ("export", "trainer export"),
    ("handoff", "hand-off"),
    ("pause", "pause"),
    ("pause/probe_wait", "of which waiting for a probe"),
    ("pause/servers", "of which pausing servers"),
    ("load", "load"),
    ("load/read", "of which reading the version (disk)"),
    ("load/servers", "of which the servers' load (disk)"),
    ("load/take", "of which taking it as current (disk)"),
    ("load/verify", "of which server check"),
    ("resume", "resume"),
    ("check", "check after resume"),
    ("roll_back", "roll-back"),
    ("unaccounted", "unaccounted"),
)


def push_breakdown_table(summaries: list[RunSummary]) -> list[str]:
    """Where a weight push's time goes, per schedule: mean milliseconds per push in each phase."""
    shown = [(key, title) for key, title in PUSH_COLUMNS if any(key in s.push_phases_s for s in summaries)]
    lines = [
        "",
        "## Weight push breakdown (mean ms per push)",
        "",
        "A push's latency is the trainer's export, the hand-off of its handle to the rollout actor, and the engine's "
        "pause (stop new calls and pause the servers with requests in flight), load (with the check of each "
        "server's weights) and resume. Under `sync` nothing is generating during a push. With "
        "`schedule.push_between_batches` (the default) a push under the overlapped schedules first waits for the "
        "batch being generated to end, then loads with nothing in flight; that wait is not part of its latency "
        "(the trainer trained or waited for that batch anyway, and generation went on) and is shown apart: it is "
        "how much later the version reached the engines.",
        "",
        "| schedule | pushes | mean latency | median latency | "
        + " | ".join(title for _, title in shown)
        + " | waited for the batch to end (not in the latency) |",
        "|---|---|---|---|" + "---|" * (len(shown) + 1),
    ]
    for s in summaries:
        mean = s.weight_sync_mean_s
        cells = [f"{s.push_phases_s[key] * 1000:.1f}" if key in s.push_phases_s else "" for key, _ in shown]
        latency = f"{mean * 1000:.1f} | {s.percentile_sync(0.5) * 1000:.1f}" if mean is not None else " | "
        waited = f"{sum(s.push_waits_s) / len(s.push_waits_s) * 1000:.1f}" if s.push_waits_s else ""
        lines.append(f"| {s.schedule} | {len(s.weight_sync_s)} | {latency} | " + " | ".join(cells) + f" | {waited} |")
    base = summaries[0]
    if base.weight_sync_mean_s and len(summaries) > 1:
        ratios = [
            f"{s.schedule} {s.weight_sync_mean_s / base.weight_sync_mean_s:.2f}× "
            f"({s.percentile_sync(0.5) / base.percentile_sync(0.5):.2f}×)"
            for s in summaries[1:]
            if s.weight_sync_mean_s is not None
        ]
        lines += ["", f"A push against a {base.schedule} push, mean (median): {', '.join(ratios)}."]
    return lines


def time_to_target_table(summaries: list[RunSummary]) -> list[str]:
    """Held-out accuracy against wall time: the time each schedule took to first reach the highest accuracy that
    every schedule reached, and that time over sync's."""
    reached = [max((a for _, a in s.accuracy_by_wall), default=None) for s in summaries]
    lines = ["", "## Time to target accuracy", ""]
    if any(r is None for r in reached):
        return lines + ["Not every schedule evaluated held-out accuracy (`rollout.eval.every_steps`).", ""]
    target = min(r for r in reached if r is not None)
    times = [time_to_accuracy(s.accuracy_by_wall, target) for s in summaries]
    base = times[0]
    lines += [
        f"Target: held-out accuracy {target:.3f}, the highest that every schedule reached (first "
        f"{summaries[0].accuracy_by_wall[0][1]:.3f}). Wall time from the first step's start to the end of the step "
        "whose evaluation first reached it; the accuracy is measured every `rollout.eval.every_steps` steps, so the "
        "times are as coarse as that.",
        "",
        "![accuracy against wall time](accuracy_vs_wall.png)",
        "",
        "| schedule | s to target | vs sync | held-out accuracy by wall time (s: accuracy) |",
        "|---|---|---|---|",
    ]
    for s, t in zip(summaries, times, strict=True):
        curve = ", ".join(f"{wall:.0f}: {acc:.3f}" for wall, acc in s.accuracy_by_wall)
        ratio = f"{t / base:.2f}" if t is not None and base else ""
        if t is None:
            lines.append(f"| {s.schedule} | not reached | | {curve} |")
        elif t <= 0:  # the first evaluation already held the target: no time to measure, not 0 s of training
            lines.append(f"| {s.schedule} | at the first evaluation | | {curve} |")
        else:
            lines.append(f"| {s.schedule} | {t:.1f} | {ratio} | {curve} |")
    return lines + [""]


def report(summaries: list[RunSummary], spec: JobSpec, split: dict, out: Path) -> str:
    """Write `out/report.md` (and its plots) comparing the schedules; returns its markdown."""
    from miles_control.job.schedules.fully_async import buffer_capacity

    full = as_schedule(spec.schedule, "fully_async")
    assert isinstance(full, FullyAsyncSchedule)
    plots = plot(summaries, out)
    base = summaries[0]
    stages = sorted({k for s in summaries for k in s.stage_s})

    def row(cells: list) -> str:
        return "| " + " | ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in cells) + " |"

    lines = [
        "# Schedule comparison",
        "",
        "## Machine and split",
        "",
        f"{split.get('machine', '')}. Under the overlapped schedules the trainer is pinned to cores "
        f"{split.get('trainer')}, the rollout actor and its engine to cores {split.get('rollout')} (`ray.cpu_split`); "
        "under sync the stages take turns and each uses every core.",
        "",
        "## Workload",
        "",
        f"Spec `{spec.name}`: engine `{spec.rollout.engine.type}`, {spec.rollout.num_prompts_per_step} prompts × "
        f"{spec.rollout.num_samples_per_prompt} samples per step, {spec.schedule.num_steps} steps, "
        f"`update_weights_interval` {full.update_weights_interval}, `max_staleness` "
        f"{full.max_staleness}, buffer {buffer_capacity(full, spec.rollout.num_prompts_per_step)} "
        f"groups, transport `{spec.sync.transport}`.",
        "",
        "## Throughput",
        "",
        "| schedule | status | steps | wall s | samples/s | tokens/s | vs sync | achieved / ideal bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        lines.append(
            row(
                [
                    s.schedule,
                    s.status,
                    s.num_steps,
                    s.wall_s,
                    s.samples_per_s,
                    s.tokens_per_s,
                    s.samples_per_s / base.samples_per_s if base.samples_per_s else 0.0,
                    s.ratio_to_ideal,
                ]
            )
        )
    lines += [
        "",
        "The ideal bound is the wall time a perfect overlap would need: max(rollout busy, trainer busy).",
        "",
        "## Time per stage (s)",
        "",
        "| schedule | " + " | ".join(stages) + " |",
        "|---|" + "---|" * len(stages),
    ]
    for s in summaries:
        lines.append(row([s.schedule, *[s.stage_s.get(k, 0.0) for k in stages]]))
    lines += [
        "",
        "## Busy and idle share per component",
        "",
        "| schedule | rollout busy s | rollout idle share | trainer busy s | trainer idle share |",
        "|---|---|---|---|---|",
    ]
    for s in summaries:
        lines.append(
            row(
                [
                    s.schedule,
                    s.rollout_busy_s,
                    1 - s.rollout_busy_s / s.wall_s,
                    s.trainer_busy_s,
                    1 - s.trainer_busy_s / s.wall_s,
                ]
            )
        )
    lines += [
        "",
        "Where the rollout's idle time between batches went (s; under `fully_async` a batch is one call of the "
        "stream): while a push ran, while a train step (and no push) ran (under `one_step_off` a batch waits for the "
        "weights of the step before it, so a train step slower than a batch leaves the engine idle), and the rest "
        "(round trips, a full buffer). The drain is the idle time after the last batch: the last step's training "
        "and push, which no schedule can overlap with generation (the evaluation of the final weights is busy time); "
        "the ideal bound does not count it.",
        "",
        "| schedule | idle between batches | while pushing | while training | other | drain after the last batch |",
        "|---|---|---|---|---|---|",
    ]
    for s in summaries:
        gaps = s.rollout_gaps_s
        keys = ("idle", "pushing", "training", "other", "drain")
        lines.append(row([s.schedule, *(gaps.get(k, 0.0) for k in keys)]))
    lines += push_breakdown_table(summaries)
    lines += time_to_target_table(summaries)
    all_steps = [k for k, _ in base.reward_by_step]
    shown = all_steps[:: max(1, -(-len(all_steps) // 10))][:10]  # at most 10 columns, evenly spaced
    lines += ["", "## Reward", "", *[f"![{p}]({p})" for p in plots], ""]
    lines += ["Mean rollout reward at some steps (every step is in the plots and in `bench.db`):", ""]
    lines += ["| schedule | " + " | ".join(f"step {k}" for k in shown) + " |"]
    lines += ["|---|" + "---|" * len(shown)]
    for s in summaries:
        by_step = dict(s.reward_by_step)
        lines.append(row([s.schedule, *[by_step.get(k, float("nan")) for k in shown]]))
    lines += ["", f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')}.", ""]
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text
