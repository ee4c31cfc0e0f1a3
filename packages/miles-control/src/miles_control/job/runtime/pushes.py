"""The trainer side of a job's weight pushes: publish a version, hand it to the rollout actor (whose engine lands it
through `miles_rollout.push.land`), settle a push left in flight between batches, fail the step on a check that
failed, and record the push's span, metrics and (once) that its pushes go unchecked."""

from __future__ import annotations

import dataclasses
from typing import Any

from miles_control.job.recorder import Recorder
from miles_rollout.push import Landed
from miles_sync import needs_receiver_ranks
from miles_sync.config import SyncConfig


@dataclasses.dataclass
class _Push:
    """A push whose landing runs on the rollout actor (`ref`), published by the trainer as `published`."""

    step: int
    version: int
    published: Any  # runtime.answers.Published
    ref: Any  # ray.ObjectRef of RolloutWorker.receive_weights
    pause_mode: str
    check_after_resume: bool


class Pushes:
    """One job's pushes from its trainer group to its rollout actor; at most one in flight."""

    def __init__(self, sync: SyncConfig, recorder: Recorder, trainer: Any, rollout: Any) -> None:
        self.sync, self.recorder, self.trainer, self.rollout = sync, recorder, trainer, rollout
        self.weight_version = 0  # what the engines hold: the last landed push's version
        self._pending: _Push | None = None  # push(between_batches=True): not settled yet
        self._said_unchecked = False  # the job said once that its pushes are not checked

    def in_flight_version(self) -> int:
        """The version of the last push if it has not landed yet (for the rollout actor to wait for), else 0."""
        return self._pending.version if self._pending is not None else 0

    def push(
        self, step: int, version: int | None = None, pause_mode: str = "in_place", between_batches: bool = False
    ) -> dict[str, float]:
        """Trainer → engines: export, publish, pause → load → version++ → resume; then check equality.

        `version` is the trainer's version (its number of train steps); the next push number by default. With
        `between_batches` (`schedule.push_between_batches`) the rollout actor applies the push once the batch it is
        generating ends, and this returns as soon as the trainer has published: `settle` waits for the engines,
        checks and records it (the next push and the end of a schedule settle it too); the returned metrics are
        then empty and recorded at `step` when settled.
        """
        self.settle()  # one push in flight at most: a version is published once the last one landed
        if between_batches and needs_receiver_ranks(self.sync):
            # a collective transport (broadcast, p2p) sends with every trainer rank taking part, inside a timeout:
            # it cannot wait for a batch to end while the trainer goes on, so it lands at once (pause_mode)
            between_batches = False
        version = self.weight_version + 1 if version is None else version
        published = self.trainer.publish_weights(version)
        assert published.handle is not None  # rank 0 publishes
        after = self.sync.check_after_resume
        ref = self.rollout.receive_weights.remote(published.handle, pause_mode, after, between_batches)
        push = _Push(step, version, published, ref, pause_mode, after)
        if not between_batches:
            return self._finish(push)
        # a transport copying in the background (tensor, pipelined) reads the live weights until its wait() returns;
        # training goes on after this
        self.trainer.wait_published()
        self._pending = push
        return {}

    def settle(self, record: bool = True) -> dict[str, float]:
        """Wait for the push `push(between_batches=True)` left in flight (if any) and check it; returns its metrics,
        recorded at its step unless `record` is False (the caller records them)."""
        push, self._pending = self._pending, None
        if push is None:
            return {}
        metrics = self._finish(push)
        if record:
            self.recorder.metrics(push.step, metrics)
        return metrics

    def _finish(self, push: _Push) -> dict[str, float]:
        import ray

        landed: Landed = ray.get(push.ref)
        self.trainer.wait_published()
        handle, published, step, version = push.published.handle, push.published, push.step, push.version
        assert handle is not None
        self.weight_version = landed.weight_version
        end, start, waited = landed.end, published.start, landed.waited
        self.recorder.span(
            "weight_sync",
            step,
            "trainer->rollout-0",
            start,
            end,
            num_bytes=handle.num_bytes,
            transport=handle.transport,
            weight_version=version,
            trainer_fingerprint=handle.fingerprint,
            engine_fingerprint=landed.fingerprint,
            export_s=published.end - start,
            num_buckets=handle.num_buckets,
            sharded_tensors=len(handle.pieces or {}),  # sent as row shards by several trainer ranks (p2p)
            base_version=handle.base_version,
            pause_mode=push.pause_mode,
            pause_s=landed.paused_s,  # generation stood still: the load, the check unless after, a roll-back
            check_after_resume=push.check_after_resume,
            rolled_back_to=landed.rolled_back_to,
            # push_between_batches: when the handle waited for the batch under way to end (nothing stood still for
            # it: the trainer trained or waited for that batch anyway); summary.py leaves it out of the push's cost
            waited=list(waited) if waited is not None else None,
            # where the push's time went: the trainer's export, the hand-off to the rollout actor, then the engine's
            # phases (pause, load, resume, ...); summary.push_breakdown averages them
            phases={"export": published.end - start, "handoff": landed.start - published.end, **landed.phases},
        )
        if self.sync.check_weights and landed.rolled_back_to is not None:
            raise RuntimeError(
                f"step {step}: the weight check after the engines resumed failed for version {version} "
                f"({landed.check_failure}); the engines were rolled back to version {landed.rolled_back_to}"
            )
        if self.sync.check_weights and not landed.matches:
            raise RuntimeError(
                f"step {step}: engine weights differ from the trainer's after the push of version "
                f"{version} (trainer {handle.fingerprint}, engine {landed.fingerprint})"
            )
        waited_s = waited[1] - waited[0] if waited is not None else 0.0
        measured = landed.weights_match if self.sync.check_weights else None
        if measured is None:
            self._say_unchecked(step)
        return {
            "sync/latency_s": end - start - waited_s,
            "sync/wait_batch_s": waited_s,
            "sync/pause_s": landed.paused_s,
            "sync/bytes": float(handle.num_bytes),
            "sync/tensors": float(handle.num_tensors),
            "sync/unchanged_tensors": float(handle.unchanged_tensors),  # sync.delta: tensors not sent
            "sync/weight_version": float(version),
        } | ({"sync/weights_match": float(measured)} if measured is not None else {})

    def _say_unchecked(self, step: int) -> None:
        """Once per job: its pushes' weights_match is unmeasured, and why."""
        if self._said_unchecked:
            return
        self._said_unchecked = True
        why = (
            "sync.check_weights is off"
            if not self.sync.check_weights
            else "the engine's servers are not checked (rollout.engine.verify_weights is off, a packed push, or an "
            "adapter SGLang serves by name: the check reaches the folder its servers read)"
        )
        self.recorder.event(
            "weights_unchecked", f"weight pushes are not checked: {why}; sync/weights_match is not recorded", step=step
        )
