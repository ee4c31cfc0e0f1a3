"""Writes spans, metrics and events of one job to the store as they happen, and hands metrics and span durations
to the job's experiment trackers (miles_control.job.tracking) beside it."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_control.job.journal import RunRecords
from miles_control.job.redact import mask_credentials, masked

if TYPE_CHECKING:
    from miles_control.job.tracking import Trackers
    from miles_rollout.engines.sglang.recovery import EngineRestart


class Recorder:
    """One job's records as they happen: into `store` (anything that keeps RunRecords: the job store), and the
    metrics and span durations to the job's trackers."""

    def __init__(self, store: RunRecords, job_id: int, trackers: Trackers | None = None) -> None:
        self.store = store
        self.job_id = job_id
        self.trackers = trackers
        self.num_engine_restarts = 0  # of this attempt's engine servers

    def span(
        self,
        stage: str,
        step: int,
        worker: str,
        start: float,
        end: float,
        num_tokens: int = 0,
        num_bytes: int = 0,
        **attrs: Any,
    ) -> None:
        span = dict(stage=stage, step=step, worker=worker, start=start, end=end)
        self.store.add_spans(self.job_id, [dict(span, num_tokens=num_tokens, num_bytes=num_bytes, attrs=attrs)])
        if self.trackers is not None:
            self.trackers.log(step, {f"time/{stage}_s": end - start})

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.store.add_metrics(self.job_id, step, metrics)
        if self.trackers is not None:
            self.trackers.log(step, metrics)

    def event(self, kind: str, message: str, step: int | None = None, **data: Any) -> None:
        """Record an event; a URL's password in it (a tracker's MLflow URI, an error quoting a URL) is masked: every
        reader of the API sees a job's events."""
        self.store.add_event(self.job_id, kind, mask_credentials(message), step, masked(data))

    def engine_restarts(self, step: int, restarts: Sequence[EngineRestart]) -> dict[str, float]:
        """Record each restart of an engine server as an `engine_restart` event of `step` (the server, its exit code,
        why, and both logs); returns the running count, `rollout/engine_restarts`, for the step's metrics."""
        for restart in restarts:
            self.event("engine_restart", restart.describe(), step=step, **dataclasses.asdict(restart))
        self.num_engine_restarts += len(restarts)
        return {"rollout/engine_restarts": float(self.num_engine_restarts)}

    def step(self, step: int, weight_version: int, start: float, end: float) -> None:
        self.store.add_step(self.job_id, step, weight_version, start, end)

    def checkpoint(self, step: int, weight_version: int, path: Path, keep: int | None = None) -> None:
        """Record a saved checkpoint; with `keep`, delete all but the newest `keep` (their rows and folders)."""
        self.store.add_checkpoint(self.job_id, step, weight_version, str(path))
        self.event("checkpoint", f"saved {path}", step=step, path=str(path))
        if keep is None:
            return
        for old in self.store.prune_checkpoints(self.job_id, keep):
            shutil.rmtree(old, ignore_errors=True)  # on another node without a shared path: that node's to clean
            self.event("checkpoint_pruned", f"deleted {old} (schedule.keep_checkpoints={keep})", step=step, path=old)

    def samples(self, step: int, samples: Sequence[Any], limit: int) -> None:
        """Keep the first sample of each of the first `limit` groups: a bounded, readable slice of a step."""
        chosen, seen = [], set()
        for sample in samples:
            if len(chosen) >= limit:
                break
            if sample.group_index not in seen:
                seen.add(sample.group_index)
                chosen.append(sample)
        if chosen:
            self.store.add_samples(
                self.job_id,
                step,
                [
                    dict(
                        prompt=s.prompt,
                        response=_response(s),
                        label=s.label,
                        reward=float(s.reward),
                        status=getattr(s.status, "value", str(s.status)),
                        weight_versions=list(s.weight_versions),
                        num_tokens=len(s.response_ids),
                        logprobs=[round(float(x), 3) for x in s.rollout_logprobs[:LOGPROBS_KEPT]] or None,
                        turns=_turns(s),
                        images=_thumbnails(s),
                    )
                    for s in chosen
                ],
            )


LOGPROBS_KEPT = 1024  # per stored sample: the dashboard's heat strip of a response's first tokens; bounds the store


def _response(sample: Any) -> str:
    """The response as people read it: a multi-turn episode's whole transcript (a line per turn: `[role] text`,
    then how it ended), else the response text."""
    episode = sample.metadata.get("episode") if isinstance(getattr(sample, "metadata", None), dict) else None
    if not isinstance(episode, dict):
        return sample.response_text
    lines = [f"[{m.get('role')}] {m.get('content')}" for m in episode.get("messages", [])]
    ended = f"[end] {episode.get('end_reason')}" + (f": {episode['error']}" if episode.get("error") else "")
    return "\n".join([*lines, ended])


THUMBNAIL_PX = 256  # a stored image's longest side: enough to read a chart or a screenshot's layout, small in SQL


def _thumbnails(sample: Any) -> list[str] | None:
    """The prompt's images as PNG data URIs at most THUMBNAIL_PX a side (None for a text sample)."""
    images = getattr(sample, "images", None)
    if not images:
        return None
    import base64
    import io

    from miles_rollout.images import open_image

    out = []
    for index, data in enumerate(images):
        image = open_image(data, f"sample image {index}")
        image.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        out.append("data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode())
    return out


def _turns(sample: Any) -> list[dict[str, str]] | None:
    """A multi-turn episode's messages ({role, content}), else None."""
    episode = sample.metadata.get("episode") if isinstance(getattr(sample, "metadata", None), dict) else None
    if not isinstance(episode, dict):
        return None
    return [{"role": str(m.get("role")), "content": str(m.get("content"))} for m in episode.get("messages", [])]
