"""JobRuntime: starts a job's actors on Ray and offers the stages a schedule calls, recording spans."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from miles_control.config import JobSpec, RayConfig
from miles_control.convert import rollout_metrics, staleness_metrics, to_train_batch
from miles_control.placement import engine_gpu_ids, make_plan, rollout_options
from miles_control.recorder import Recorder
from miles_control.runtime.trainers import TrainerGroup
from miles_control.runtime.workers import (
    Evaluated,
    Received,
    RolloutWorker,
    TakenBatch,
)
from miles_sync import needs_receiver_ranks

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Push:
    """A push whose receive runs on the rollout actor (`ref`), published by the trainer as `published`."""

    step: int
    version: int
    published: Any  # runtime.answers.Published
    ref: Any  # ray.ObjectRef of RolloutWorker.receive_weights
    pause_mode: str
    check_after_resume: bool


ROLLOUT_STATE = "rollout.json"  # in a checkpoint folder: how many prompts the steps up to it drew

# Quiet, offline workers: nothing may be fetched from a hub at run time.
WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def ensure_ray(config: RayConfig) -> bool:
    """Connect to the configured cluster or start a local instance; True if this call started it. Workers get
    this process's MILES_PLUGIN_DIRS (plug-in modules beside the job file; the paths must exist where they run).
    A Ray instance started before this call keeps its own environment."""
    import ray

    from miles_rollout.plugins import PLUGIN_DIRS_ENV

    if ray.is_initialized():
        return False
    env = dict(WORKER_ENV)
    if os.environ.get(PLUGIN_DIRS_ENV):
        env[PLUGIN_DIRS_ENV] = os.environ[PLUGIN_DIRS_ENV]
    ray.init(
        # "local": always a new instance of our own. With None, Ray would join whatever
        # /tmp/ray/ray_current_cluster names (e.g. the API server's shared head, or a dead one: a hang).
        address=config.address or "local",
        num_cpus=config.num_cpus if config.address is None else None,
        include_dashboard=False,
        log_to_driver=os.environ.get("MILES_RAY_LOG_TO_DRIVER") == "1",
        runtime_env={"env_vars": env},
    )
    return True


def split_cpus() -> dict[str, list[int]]:
    """Disjoint cores of this machine: the trainer the first half, rollout the rest (at least one each)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError(f"ray.cpu_split needs at least 2 CPU cores; this process may use {cores}")
    half = len(cores) // 2
    return {"trainer": cores[:half], "rollout": cores[half:]}


class JobRuntime:
    """The stages of one job, each recorded as a span: generate, train, push weights, evaluate."""

    def __init__(
        self,
        spec: JobSpec,
        model_path: Path,
        recorder: Recorder,
        train_prompts: list,
        eval_prompts: list,
        run_dir: Path,
    ) -> None:
        import ray

        from miles_rollout.engines.checkpoint import engine_dtype

        # The engines run the checkpoint's dtype unless the spec names another; pushes send it (sync.dtype: auto).
        self.engine_dtype = engine_dtype(spec.rollout.engine.dtype, model_path)
        spec = spec.model_copy(update={"sync": spec.sync.for_engines(self.engine_dtype)})
        # The precision of the policy the engines run: what the trainer forwards with (policy_weights: auto).
        self.pushed_precision = spec.sync.pushed_precision(self.engine_dtype)
        recorder.event(
            "weights",
            f"engines hold {self.engine_dtype}; pushes send {spec.sync.dtype or 'the trainer dtype'}",
            engine_dtype=self.engine_dtype,
            wire_dtype=spec.sync.dtype,
            pushed_precision=self.pushed_precision,
        )
        self.spec = spec
        self.recorder = recorder
        self.prompts_used = 0  # prompts drawn for the batches recorded so far (what a checkpoint stores)
        self._said_unchecked = False  # the job said once that its pushes are not checked
        self.run_dir = run_dir
        self.weight_version = 0
        self._warned_update_lost = False
        self._pending_push: _Push | None = None  # push_weights(between_batches=True): not settled yet
        if spec.rollout.partial_rollouts and getattr(spec.schedule, "push_between_batches", False):
            message = (
                "rollout.partial_rollouts continues requests a push aborts, but schedule.push_between_batches makes "
                "pushes land between batches, with none of a batch's requests in flight: set "
                "schedule.push_between_batches=false (and pause_mode=abort) to push into running requests"
            )
            log.warning(message)
            recorder.event("warning", message)
        self.cpu_split = split_cpus() if spec.ray.cpu_split else {"trainer": None, "rollout": None}
        if spec.ray.cpu_split:
            recorder.event(
                "cpu_split",
                f"trainer on cores {self.cpu_split['trainer']}, rollout on {self.cpu_split['rollout']}",
                **self.cpu_split,
            )
        # The resource plan, checked against the cluster before any actor starts (miles_control.placement).
        self.plan = make_plan(spec, ray.cluster_resources())
        recorder.event("placement", self.plan.describe(), **dataclasses.asdict(self.plan))

        def start_rollout(trainer_group: Any = None, engine_gpus: list[list[str]] | None = None) -> Any:
            return (
                ray.remote(RolloutWorker)
                # Threads: a weight push, an evaluation, a take() and the next batch (waiting for this one) may run
                # while generation goes on.
                .options(**rollout_options(self.plan, trainer_group), max_concurrency=8)
                .remote(
                    spec.model_dump(mode="json"),
                    str(model_path),
                    train_prompts,
                    eval_prompts,
                    self.cpu_split["rollout"],
                    self.plan,
                    engine_gpus,
                )
            )

        def start_trainer(receiver_ranks: int) -> TrainerGroup:
            return TrainerGroup(
                spec,
                model_path,
                run_dir / "weights",
                receiver_ranks,
                self.cpu_split["trainer"],
                self.pushed_precision,
                self.plan,
            )

        if self.plan.mode == "colocated":
            # The engines run on the trainer ranks' GPUs: the trainer is placed first (broadcast is refused here).
            self.trainer = start_trainer(1)
            engine_gpus = engine_gpu_ids(self.plan, self.trainer.gpu_ids())
            self.rollout = start_rollout(self.trainer.placement_group, engine_gpus)
        else:
            self.rollout = start_rollout()
            # A collective transport's group has a rank for every receiver the engine brings (asking waits for
            # the engine to start, so only then; other transports start trainer and engine side by side).
            asks = needs_receiver_ranks(spec.sync)
            receiver_ranks = ray.get(self.rollout.receiver_ranks.remote()) if asks else 1
            self.trainer = start_trainer(receiver_ranks)
        trainer_nodes = self.trainer.node_ids()
        rollout_node = ray.get(self.rollout.node_id.remote())
        recorder.event(
            "nodes",
            f"trainer rank(s) on Ray node(s) {', '.join(dict.fromkeys(n[:8] for n in trainer_nodes))}, rollout on "
            f"{rollout_node[:8]}",
            trainer=trainer_nodes,
            rollout=rollout_node,
        )

    def generate(self, step: int):

        return self.collect(step, self.generate_async())

    def generate_async(self):
        """Start generating one step's batch; `collect` it later (one_step_off overlaps it with training). It runs
        on the weights of the last push: the rollout actor starts it once they are loaded (a push between batches
        lands when the batch under way ends)."""
        return self.rollout.generate.remote(self._last_pushed_version())

    def _last_pushed_version(self) -> int:
        """The version of the last push if it has not landed yet (for the rollout actor to wait for), else 0."""
        return self._pending_push.version if self._pending_push is not None else 0

    def collect(self, step: int, ref):
        import ray

        wait_start = time.time()
        batch = ray.get(ref)
        self.recorder.span("wait_rollout", step, "trainer", wait_start, time.time())
        return self._record_batch(step, batch), rollout_metrics(batch)

    def _record_batch(self, step: int, batch):
        self.prompts_used += int(batch.metrics.get("rollout/prompts_drawn", 0))
        for t in batch.timings:
            worker = "trainer" if t.stage == "wait_rollout" else "rollout-0"
            self.recorder.span(t.stage, step, worker, t.start, t.end, num_tokens=t.num_tokens)
        self.recorder.samples(step, batch.samples, self.spec.store.samples_per_step)
        return batch

    # ---- fully_async ---------------------------------------------------------------------------

    def start_stream(self, capacity: int, chunk_prompts: int) -> None:
        import ray

        ray.get(self.rollout.start_stream.remote(capacity, chunk_prompts))

    def take(self, step: int, num_groups: int, trainer_version: int, max_staleness: int, policy: str):
        import ray

        taken: TakenBatch = ray.get(
            self.rollout.take.remote(num_groups, trainer_version, max_staleness, policy, 1800.0)
        )
        self._record_batch(step, taken.batch)
        metrics = rollout_metrics(taken.batch)
        metrics |= staleness_metrics(taken.staleness)
        metrics["async/dropped_groups"] = float(taken.dropped)
        metrics["async/regenerated_groups"] = float(taken.regenerated)
        metrics["async/buffered_groups"] = float(taken.buffered)
        return taken.batch, taken.staleness, metrics

    def resize_buffer(self, capacity: int) -> None:
        import ray

        ray.get(self.rollout.resize_buffer.remote(capacity))

    def stop_stream(self) -> None:
        import ray

        ray.get(self.rollout.stop_stream.remote())

    def evaluate_async(self):
        """Start an evaluation; it runs on the weights of the last push, once they are loaded (a push between
        batches may still wait for the batch under way)."""
        return self.rollout.evaluate.remote(self._last_pushed_version())

    def eval_result(self, ref: Any, wait: bool) -> Evaluated | None:
        """The result of `evaluate_async`'s `ref` once it is ready (waiting for it when `wait`), else None."""
        import ray

        ready, _ = ray.wait([ref], timeout=None if wait else 0)
        return ray.get(ref) if ready else None

    def record_eval(self, step: int, result: Evaluated) -> dict[str, float]:
        self.recorder.span("eval", step, "rollout-0", result.start, result.end)
        return result.metrics

    def train(self, step: int, batch, staleness: list[int] | None = None) -> dict[str, float]:
        import ray

        train_batch = to_train_batch(batch, staleness)
        colocated = self.plan.mode == "colocated"
        if colocated:  # the engines give their GPU memory to the trainer for the step, then take it back
            ray.get(self.rollout.release_memory.remote())
        try:
            result = self.trainer.train_step(train_batch)
        finally:
            if colocated:
                ray.get(self.rollout.resume_memory.remote())
        metrics = result.metrics | ray.get(self.rollout.usage.remote())  # the rollout side's since the last step
        metrics |= self.recorder.engine_restarts(step, ray.get(self.rollout.engine_restarts.remote()))
        num_tokens = int(metrics["train/num_tokens"])
        self.recorder.span("train", step, "trainer", result.start, result.end, num_tokens=num_tokens)
        metrics["train/tokens_per_s"] = num_tokens / max(result.end - result.start, 1e-9)
        self._warn_if_update_lost(step, metrics.get("train/update_kept_frac"))
        return metrics

    def _warn_if_update_lost(self, step: int, kept: float | None) -> None:
        """Once per run: most of a step's weight changes are below the engines' precision."""
        if kept is None or kept >= 0.5 or self._warned_update_lost:
            return
        self._warned_update_lost = True
        message = (
            f"step {step}: only {kept:.0%} of the weights this step changed reach the engines, which run "
            f"{self.pushed_precision} weights: smaller changes round away at the push. They are kept in the fp32 master weights "
            f"until they add up (and the trainer forwards with the weights as pushed, so both sides still run the "
            f"same policy), but the engines' policy moves slower than the optimizer's. A larger learning rate, or "
            f"engines in float32 (rollout.engine.dtype), let more of each update through; see train/update_kept_frac."
        )
        log.warning(message)
        self.recorder.event("warning", message, step=step, update_kept_frac=kept)

    def push_weights(
        self, step: int, version: int | None = None, pause_mode: str = "in_place", between_batches: bool = False
    ) -> dict[str, float]:
        """Trainer → engines: export, publish, pause → load → version++ → resume; then check equality.

        `version` is the trainer's version (its number of train steps); the next push number by default. With
        `between_batches` (`schedule.push_between_batches`) the rollout actor applies the push once the batch it is
        generating ends, and this returns as soon as the trainer has published: `settle_push` waits for the engines,
        checks and records it (the next push and the end of a schedule settle it too); the returned metrics are
        then empty and recorded at `step` when settled.
        """
        self.settle_push()  # one push in flight at most: a version is published once the last one landed
        if between_batches and needs_receiver_ranks(self.spec.sync):
            # a collective transport (broadcast, p2p) sends with every trainer rank taking part, inside a timeout:
            # it cannot wait for a batch to end while the trainer goes on, so it lands at once (pause_mode)
            between_batches = False
        version = self.weight_version + 1 if version is None else version
        published = self.trainer.publish_weights(version)
        assert published.handle is not None  # rank 0 publishes
        after = self.spec.sync.check_after_resume
        ref = self.rollout.receive_weights.remote(published.handle, pause_mode, after, between_batches)
        push = _Push(step, version, published, ref, pause_mode, after)
        if not between_batches:
            return self._finish_push(push)
        # a transport copying in the background (tensor, pipelined) reads the live weights until its wait() returns;
        # training goes on after this
        self.trainer.wait_published()
        self._pending_push = push
        return {}

    def settle_push(self, record: bool = True) -> dict[str, float]:
        """Wait for the push `push_weights(between_batches=True)` left in flight (if any) and check it; returns its
        metrics, recorded at its step unless `record` is False (the caller records them)."""
        push, self._pending_push = self._pending_push, None
        if push is None:
            return {}
        metrics = self._finish_push(push)
        if record:
            self.recorder.metrics(push.step, metrics)
        return metrics

    def _finish_push(self, push: _Push) -> dict[str, float]:
        import ray

        received: Received = ray.get(push.ref)
        self.trainer.wait_published()
        handle, published, step, version = push.published.handle, push.published, push.step, push.version
        assert handle is not None
        self.weight_version = received.weight_version
        engine_fp, end, start = received.fingerprint, received.end, published.start
        match = engine_fp == handle.fingerprint and received.check_failure is None
        waited = received.waited
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
            engine_fingerprint=engine_fp,
            export_s=published.end - start,
            num_buckets=handle.num_buckets,
            sharded_tensors=len(handle.pieces or {}),  # sent as row shards by several trainer ranks (p2p)
            base_version=handle.base_version,
            pause_mode=push.pause_mode,
            pause_s=received.paused_s,  # generation stood still: the load, the check unless after, a roll-back
            check_after_resume=push.check_after_resume,
            rolled_back_to=received.rolled_back_to,
            # push_between_batches: when the handle waited for the batch under way to end (nothing stood still for
            # it: the trainer trained or waited for that batch anyway); summary.py leaves it out of the push's cost
            waited=list(waited) if waited is not None else None,
            # where the push's time went: the trainer's export, the hand-off to the rollout actor, then the engine's
            # phases (pause, load, resume, ...); summary.push_breakdown averages them
            phases={"export": published.end - start, "handoff": received.start - published.end, **received.phases},
        )
        if self.spec.sync.check_weights and received.rolled_back_to is not None:
            raise RuntimeError(
                f"step {step}: the weight check after the engines resumed failed for version {version} "
                f"({received.check_failure}); the engines were rolled back to version {received.rolled_back_to}"
            )
        if self.spec.sync.check_weights and not match:
            raise RuntimeError(
                f"step {step}: engine weights differ from the trainer's after the push of version "
                f"{version} (trainer {handle.fingerprint}, engine {engine_fp})"
            )
        waited_s = waited[1] - waited[0] if waited is not None else 0.0
        checked = self.spec.sync.check_weights and received.checked
        if not checked and not self._said_unchecked:  # once per job: the pushes' weights_match is unmeasured
            self._said_unchecked = True
            why = (
                "sync.check_weights is off"
                if not self.spec.sync.check_weights
                else "the engine's servers are not checked (rollout.engine.verify_weights is off, a packed push, or an adapter SGLang serves by name: the check reaches the folder its servers read)"
            )
            self.recorder.event(
                "weights_unchecked",
                f"weight pushes are not checked: {why}; sync/weights_match is not recorded",
                step=step,
            )
        return {
            "sync/latency_s": end - start - waited_s,
            "sync/wait_batch_s": waited_s,
            "sync/pause_s": received.paused_s,
            "sync/bytes": float(handle.num_bytes),
            "sync/tensors": float(handle.num_tensors),
            "sync/unchanged_tensors": float(handle.unchanged_tensors),  # sync.delta: tensors not sent
            "sync/weight_version": float(version),
        } | ({"sync/weights_match": float(match)} if checked else {})

    def evaluate(self, step: int) -> dict[str, float]:
        import ray

        return self.record_eval(step, ray.get(self.rollout.evaluate.remote()))

    def save(self, directory: Path) -> None:
        self.trainer.save(directory)

    def checkpoint_if_due(self, step: int) -> None:
        every = self.spec.schedule.checkpoint_every
        if every and step % every == 0:
            self.checkpoint(step)

    def checkpoint(self, step: int) -> Path:
        """Save the trainer (weights + optimizer) after `step`; a resume starts from the newest one."""
        directory = self.run_dir / "checkpoints" / f"step-{step}"
        start = time.time()
        self.save(directory)
        # where the prompt stream stands (dynamic sampling draws a varying number of prompts per step); the folder
        # is the trainer's: on another node without a shared path the driver cannot write it, and a resume falls
        # back to num_prompts_per_step a step
        if directory.is_dir():
            (directory / ROLLOUT_STATE).write_text(json.dumps({"prompts_drawn": self.prompts_used}))
        self.recorder.span("checkpoint", step, "trainer", start, time.time())
        self.recorder.checkpoint(step, self.weight_version, directory, keep=self.spec.schedule.keep_checkpoints)
        return directory

    def start_weights(self) -> None:
        """Before the first step: the engines loaded the checkpoint as it is; a quantized push
        (`sync.quantization`) replaces it with its quantized weights (version 0), so that step 1 already generates
        with the numerics every later step uses."""
        if self.spec.sync.quantization != "none":
            self.push_weights(0, version=0)

    def restore(self, directory: Path, step: int) -> dict[str, float]:
        """Load a checkpoint into the trainer and push its weights to the engines, as version `step`."""
        import ray

        start = time.time()
        self.trainer.load(directory)
        # The prompts of steps 1..step were trained on already (fully_async: about that many): as the checkpoint
        # recorded them, or (a checkpoint made before it did) num_prompts_per_step a step.
        state = directory / ROLLOUT_STATE
        drawn = step * self.spec.rollout.num_prompts_per_step
        if state.exists():
            drawn = int(json.loads(state.read_text())["prompts_drawn"])
        ray.get(self.rollout.skip_prompts.remote(drawn))
        self.prompts_used = drawn
        self.recorder.span("restore", step, "trainer", start, time.time())
        self.recorder.event("resume", f"resumed from {directory} (after step {step})", step=step, path=str(directory))
        return self.push_weights(step, version=step)

    def shutdown(self) -> None:
        import ray

        started = time.time()
        try:
            self.trainer.shutdown()
        finally:
            try:
                ray.get(self.rollout.shutdown.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - the actor is killed below either way
                log.debug("rollout shutdown failed", exc_info=True)
            ray.kill(self.rollout)
        log.debug("runtime shut down in %.1fs", time.time() - started)
