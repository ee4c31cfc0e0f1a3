"""The one summary of a run, read back from the store: time per stage, throughput, busy and idle time per
component, the ideal-overlap bound, weight-update latency, reward and accuracy curves.

`miles run` prints it, `miles bench schedules` reports it side by side, and the API serves it
(`GET /api/v1/jobs/{id}/summary`) to the dashboard, so that the three cannot show different numbers.

Definitions:

- the loop's wall time runs from the first step's start to the last step's end; the spans counted are
  those of steps ≥ 1 (step 0 is the evaluation before training and a restore), clipped to that window;
- a stage's share is its summed span time over the wall time; in an asynchronous schedule stages overlap
  and the shares add up to more than 1;
- `wait_rollout` is the trainer waiting for data: idle time, reported but not counted as work;
- busy time per component is the union of its spans (rollout actor: rollout, reward, eval; trainer:
  train, weight_sync); with perfect overlap a loop costs its busier component, so
  `ideal_wall_s = max(rollout busy, trainer busy)` and `ratio_to_ideal` = ideal / achieved (≤ 1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from miles_control.service.store import Store

STAGE_ORDER = ("rollout", "reward", "judge", "train", "weight_sync", "eval", "wait_rollout")
ROLLOUT_STAGES = ("rollout", "reward", "judge", "eval")  # judge: a judge model's reward (rollout.reward: judge)
TRAINER_STAGES = ("train", "weight_sync")
IDLE_STAGES = ("wait_rollout",)


@dataclass
class StageSummary:
    stage: str
    count: int
    total_s: float
    share_of_wall: float
    num_tokens: int
    idle: bool = False  # time a component spent waiting, not working

    @property
    def tokens_per_s(self) -> float | None:
        return self.num_tokens / self.total_s if self.num_tokens and self.total_s > 0 else None


@dataclass
class RunSummary:
    job_id: int
    status: str
    schedule: str
    num_steps: int
    wall_s: float
    samples: int  # trained: steps × prompts per step × samples per prompt
    tokens: float  # trained response tokens (train/num_tokens summed)
    stages: list[StageSummary] = field(default_factory=list)
    rollout_busy_s: float = 0.0
    trainer_busy_s: float = 0.0
    weight_sync_s: list[float] = field(default_factory=list)
    # mean seconds per push in each phase ("export", "handoff", "pause", "load", "resume", ...; "pause/probe_wait"
    # and "load/verify" are parts of their phase) and "unaccounted": the latency the phases do not cover
    push_phases_s: dict[str, float] = field(default_factory=dict)
    # schedule.push_between_batches: seconds each push waited for the batch under way to end (not part of its cost:
    # neither the trainer nor the engines stood still for it; the push's version arrived that much later)
    push_waits_s: list[float] = field(default_factory=list)
    # the rollout's idle time between one batch (a fully_async call) and the next, in seconds: "idle", of which
    # "pushing" (a push ran), "training" (a train step and no push ran: under one_step_off the next batch waits for
    # its weights) and "other" (scheduling, round trips, a full buffer); and "drain": idle after the last batch (the
    # last step's training and push, which no schedule overlaps with generation; evaluation is not idle)
    rollout_gaps_s: dict[str, float] = field(default_factory=dict)
    eval_accuracy: list[tuple[int, float]] = field(default_factory=list)
    reward_by_step: list[tuple[int, float]] = field(default_factory=list)
    reward_by_wall: list[tuple[float, float]] = field(default_factory=list)  # seconds since the first step
    # held-out accuracy at the end of the step it was measured at (step 0: before training, at 0 s)
    accuracy_by_wall: list[tuple[float, float]] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def ideal_wall_s(self) -> float:
        return max(self.rollout_busy_s, self.trainer_busy_s)

    @property
    def ratio_to_ideal(self) -> float:
        return self.ideal_wall_s / self.wall_s if self.wall_s else 0.0

    @property
    def stage_s(self) -> dict[str, float]:
        return {st.stage: st.total_s for st in self.stages}

    @property
    def work_s(self) -> float:
        """Summed time of the stages that are work (not waiting)."""
        return sum(st.total_s for st in self.stages if not st.idle)

    @property
    def overlapping(self) -> bool:
        """The stages ran concurrently (their time adds up to more than the wall time)."""
        return self.work_s > self.wall_s * 1.01

    @property
    def weight_sync_mean_s(self) -> float | None:
        return sum(self.weight_sync_s) / len(self.weight_sync_s) if self.weight_sync_s else None

    def percentile_sync(self, q: float) -> float:
        values = sorted(self.weight_sync_s)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]

    def to_dict(self) -> dict:
        """Fields and derived numbers, as the API serves them."""
        data = asdict(self)
        for st, out in zip(self.stages, data["stages"], strict=True):
            out["tokens_per_s"] = st.tokens_per_s
        for name in ("samples_per_s", "tokens_per_s", "ideal_wall_s", "ratio_to_ideal", "weight_sync_mean_s"):
            data[name] = getattr(self, name)
        return data


def union_seconds(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of intervals, clipped to [lo, hi]."""
    total = 0.0
    current: tuple[float, float] | None = None  # the merged interval being extended
    for start, end in sorted((max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi):
        if current is None or start > current[1]:
            if current is not None:
                total += current[1] - current[0]
            current = (start, end)
        else:
            current = (current[0], max(current[1], end))
    if current is not None:
        total += current[1] - current[0]
    return total


def push_breakdown(pushes: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Mean seconds per push in each phase, from (latency, phases) pairs; "unaccounted" is the mean latency less
    the top-level phases (a name with a "/" is part of another phase)."""
    if not pushes:
        return {}
    names = sorted({name for _, phases in pushes for name in phases})
    mean = {name: sum(phases.get(name, 0.0) for _, phases in pushes) / len(pushes) for name in names}
    covered = sum(value for name, value in mean.items() if "/" not in name)
    if names:
        mean["unaccounted"] = sum(latency for latency, _ in pushes) / len(pushes) - covered
    return mean


def rollout_gaps(spans: list[Any], loop_end: float | None = None) -> dict[str, float]:
    """Where the rollout's idle time between consecutive batches went (see RunSummary.rollout_gaps_s); with
    `loop_end`, also its idle time after the last batch (`drain`)."""
    batches = sorted((sp.start, sp.end) for sp in spans if sp.stage == "rollout")
    trains = [(sp.start, sp.end) for sp in spans if sp.stage == "train"]
    pushes = [part for sp in spans if sp.stage == "weight_sync" for part in _busy_parts(sp)]
    idle = pushing = busy = 0.0
    for (_, end), (start, _) in zip(batches, batches[1:], strict=False):
        if start <= end:
            continue
        idle += start - end
        pushing += union_seconds(pushes, end, start)  # first: the next train step may start beside a push
        busy += union_seconds(trains + pushes, end, start)
    if not batches:
        return {}
    gaps = {"idle": idle, "pushing": pushing, "training": busy - pushing, "other": idle - busy}
    if loop_end is not None:  # the last step's training and push, then the evaluation of the final weights
        last = max(end for _, end in batches)
        evals = [(sp.start, sp.end) for sp in spans if sp.stage == "eval"]
        gaps["drain"] = max(0.0, loop_end - last - union_seconds(evals, last, loop_end))
    return gaps


def _phases(span: Any) -> dict[str, float]:
    return (span.attrs or {}).get("phases") or {}


def _waited_s(span: Any) -> float:
    """How long a push waited for the batch under way to end (`schedule.push_between_batches`), else 0."""
    waited = (span.attrs or {}).get("waited")
    return waited[1] - waited[0] if waited else 0.0


def _busy_parts(span: Any) -> list[tuple[float, float]]:
    """A span's busy intervals: a push that waited for a batch to end was busy before and after the wait only."""
    waited = (span.attrs or {}).get("waited") if span.stage == "weight_sync" else None
    if not waited:
        return [(span.start, span.end)]
    return [(span.start, waited[0]), (waited[1], span.end)]


def summarize(store: Store, job_id: int) -> RunSummary:
    """The summary of job `job_id` as the store holds it now (a running job: the steps so far)."""
    job = store.job(job_id)
    spec = job.spec or {}
    rollout = spec.get("rollout", {})
    samples_per_step = int(rollout.get("num_prompts_per_step", 0)) * int(rollout.get("num_samples_per_prompt", 0))
    steps = [s for s in store.steps(job_id) if s.ended_at is not None]
    summary = RunSummary(
        job_id=job_id,
        status=job.status,
        schedule=str(spec.get("schedule", {}).get("type", "")),
        num_steps=len(steps),
        wall_s=0.0,
        samples=len(steps) * samples_per_step,
        tokens=sum(v for _, v in store.metric_series(job_id, "train/num_tokens")),
        eval_accuracy=store.metric_series(job_id, "eval/accuracy"),
    )
    if not steps:
        return summary
    lo, hi = steps[0].started_at, steps[-1].ended_at
    spans = [s for s in store.spans(job_id) if s.step >= 1 and s.end > lo and s.start < hi]
    summary.wall_s = hi - lo
    names = [s for s in STAGE_ORDER if any(sp.stage == s for sp in spans)]
    names += sorted({sp.stage for sp in spans} - set(names))
    for name in names:
        mine = [sp for sp in spans if sp.stage == name]
        total = sum(min(sp.end, hi) - max(sp.start, lo) for sp in mine)
        summary.stages.append(
            StageSummary(
                name,
                len(mine),
                total,
                total / summary.wall_s if summary.wall_s else 0.0,
                sum(sp.num_tokens for sp in mine),
                idle=name in IDLE_STAGES,
            )
        )
    summary.rollout_busy_s = union_seconds([(s.start, s.end) for s in spans if s.stage in ROLLOUT_STAGES], lo, hi)
    summary.trainer_busy_s = union_seconds(
        [part for s in spans if s.stage in TRAINER_STAGES for part in _busy_parts(s)], lo, hi
    )
    summary.rollout_gaps_s = rollout_gaps(spans, hi)
    pushes = [sp for sp in spans if sp.stage == "weight_sync"]
    summary.push_waits_s = [_waited_s(sp) for sp in pushes]
    summary.weight_sync_s = [sp.end - sp.start - _waited_s(sp) for sp in pushes]
    summary.push_phases_s = push_breakdown(
        [
            (sp.end - sp.start - _waited_s(sp), {k: v for k, v in _phases(sp).items() if k != "wait_batch"})
            for sp in pushes
        ]
    )
    summary.reward_by_step = store.metric_series(job_id, "rollout/reward_mean")
    step_end = {st.step: st.ended_at - lo for st in steps}
    summary.reward_by_wall = [(step_end[k], v) for k, v in summary.reward_by_step if k in step_end]
    step_end[0] = 0.0
    summary.accuracy_by_wall = [(step_end[k], v) for k, v in summary.eval_accuracy if k in step_end]
    return summary


def time_to_accuracy(points: list[tuple[float, float]], target: float) -> float | None:
    """The first wall time (s since the first step) at which held-out accuracy reached `target`; None if never."""
    return next((wall for wall, accuracy in sorted(points) if accuracy >= target), None)
