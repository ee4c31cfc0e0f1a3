"""Summaries of a finished run, read back from the store: time per stage, throughput, sync latency."""

from __future__ import annotations

from dataclasses import dataclass, field

from miles_control.store import Store

STAGE_ORDER = ("rollout", "reward", "train", "weight_sync", "eval")


@dataclass
class StageSummary:
    stage: str
    count: int
    total_s: float
    share_of_wall: float
    num_tokens: int

    @property
    def tokens_per_s(self) -> float | None:
        return self.num_tokens / self.total_s if self.num_tokens and self.total_s > 0 else None


@dataclass
class RunSummary:
    job_id: int
    status: str
    num_steps: int
    wall_s: float
    stages: list[StageSummary] = field(default_factory=list)
    weight_sync_s: list[float] = field(default_factory=list)
    eval_accuracy: list[tuple[int, float]] = field(default_factory=list)

    def percentile_sync(self, q: float) -> float:
        values = sorted(self.weight_sync_s)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summarize(store: Store, job_id: int) -> RunSummary:
    job = store.job(job_id)
    spans = store.spans(job_id)
    steps = store.steps(job_id)
    wall = (max(s.end for s in spans) - min(s.start for s in spans)) if spans else 0.0
    stages = []
    names = [s for s in STAGE_ORDER if any(sp.stage == s for sp in spans)]
    names += sorted({sp.stage for sp in spans} - set(names))
    for name in names:
        mine = [sp for sp in spans if sp.stage == name]
        total = sum(sp.duration for sp in mine)
        stages.append(
            StageSummary(name, len(mine), total, total / wall if wall else 0.0, sum(sp.num_tokens for sp in mine))
        )
    return RunSummary(
        job_id=job_id,
        status=job.status,
        num_steps=len(steps),
        wall_s=wall,
        stages=stages,
        weight_sync_s=[sp.duration for sp in spans if sp.stage == "weight_sync"],
        eval_accuracy=store.metric_series(job_id, "eval/accuracy"),
    )
