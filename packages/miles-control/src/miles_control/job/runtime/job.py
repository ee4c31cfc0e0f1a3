"""JobRuntime: starts a job's actors on Ray and offers the stages a schedule calls, recording spans."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from miles_control.job.convert import rollout_metrics, staleness_metrics, to_train_batch
from miles_control.job.placement import engine_gpu_ids, make_plan, rollout_options
from miles_control.job.recorder import Recorder
from miles_control.job.runtime.cpus import COST_STEPS, cpu_plan, split_cpus, trainer_share
from miles_control.job.runtime.pushes import Pushes
from miles_control.job.runtime.trainers import TrainerGroup
from miles_control.job.runtime.workers import Evaluated, RolloutWorker, TakenBatch
from miles_control.spec.config import JobSpec, RayConfig
from miles_sync import needs_receiver_ranks

log = logging.getLogger(__name__)


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

    from miles_rollout.plugin_check import PLUGIN_DIRS_ENV

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
        self.run_dir = run_dir
        self._warned_update_lost = False
        if spec.rollout.partial_rollouts and getattr(spec.schedule, "push_between_batches", False):
            message = (
                "rollout.partial_rollouts continues requests a push aborts, but schedule.push_between_batches makes "
                "pushes land between batches, with none of a batch's requests in flight: set "
                "schedule.push_between_batches=false (and pause_mode=abort) to push into running requests"
            )
            log.warning(message)
            recorder.event("warning", message)
        self.cpu_split = cpu_plan(spec)
        self.stage_seconds: dict[str, list[float]] = {"rollout": [], "train": []}  # busy time of each stage
        self._costs_followed = False
        if spec.ray.cpu_split:
            placed = self.cpu_split["trainer"] is not None
            recorder.event(
                "cpu_split",
                f"trainer on cores {self.cpu_split['trainer']}, rollout on {self.cpu_split['rollout']}"
                if placed
                else f"not applied: under {spec.schedule.type} the stages take turns, so each uses every core",
                **self.cpu_split,
            )
        # The resource plan, checked against the cluster before any actor starts (miles_control.job.placement).
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
        self.pushes = Pushes(spec.sync, recorder, self.trainer, self.rollout)

    def generate(self, step: int):

        return self.collect(step, self.generate_async())

    def generate_async(self):
        """Start generating one step's batch; `collect` it later (one_step_off overlaps it with training). It runs
        on the weights of the last push: the rollout actor starts it once they are loaded (a push between batches
        lands when the batch under way ends)."""
        return self.rollout.generate.remote(self._last_pushed_version())

    def _last_pushed_version(self) -> int:
        """The version of the last push if it has not landed yet (for the rollout actor to wait for), else 0."""
        return self.pushes.in_flight_version()

    def follow_stage_costs(self, step: int) -> None:
        """Once, after `COST_STEPS` steps of an overlapped schedule under `ray.cpu_split`: split the cores in the
        shares that make both stages take as long (their busy seconds per step × the cores they had), and move
        the trainer ranks and the rollout actor (with its engine's servers) there. The event says what was
        measured and what it chose."""
        split = self.cpu_split
        if self._costs_followed or step < COST_STEPS or split["trainer"] is None or split["rollout"] is None:
            return
        self._costs_followed = True
        train_s = sum(self.stage_seconds["train"]) / max(len(self.stage_seconds["train"]), 1)
        rollout_s = sum(self.stage_seconds["rollout"]) / max(len(self.stage_seconds["train"]), 1)
        share = trainer_share(train_s, len(split["trainer"]), rollout_s, len(split["rollout"]))
        new = split_cpus(share, split["trainer"] + split["rollout"])
        measured = f"train {train_s:.3f} s on {len(split['trainer'])} cores, rollout {rollout_s:.3f} s on {len(split['rollout'])} per step"
        if new == split:
            self.recorder.event("cpu_split", f"kept after {step} steps ({measured})", **split)
            return
        import ray

        self.trainer.repin(new["trainer"])
        ray.get(self.rollout.repin.remote(new["rollout"]))
        self.cpu_split = new
        self.recorder.event(
            "cpu_split",
            f"after {step} steps ({measured}): trainer on cores {new['trainer']}, rollout on {new['rollout']}",
            **new,
        )

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
            if t.stage == "rollout" and not self._costs_followed:  # kept only until the split follows them
                self.stage_seconds["rollout"].append(t.end - t.start)
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
        if not self._costs_followed:
            self.stage_seconds["train"].append(result.end - result.start)
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

    # ---- weight pushes: runtime/pushes.py ---------------------------------------------------------

    @property
    def weight_version(self) -> int:
        """The version the engines hold (the last push's)."""
        return self.pushes.weight_version

    def push_weights(
        self, step: int, version: int | None = None, pause_mode: str = "in_place", between_batches: bool = False
    ) -> dict[str, float]:
        """Trainer → engines (`Pushes.push`): export, publish, land on the engines, check, record."""
        return self.pushes.push(step, version, pause_mode, between_batches)

    def settle_push(self, record: bool = True) -> dict[str, float]:
        """Wait for a push left in flight between batches and check it (`Pushes.settle`)."""
        return self.pushes.settle(record)

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
