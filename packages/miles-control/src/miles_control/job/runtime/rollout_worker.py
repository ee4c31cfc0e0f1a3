"""The rollout actor: the engine, the tokenizer, the rollout manager and the prompt streams, and fully_async's
continuous generation into a bounded buffer. A plain class; `ray.remote` is applied where it is started."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_control.job.placement import Plan, engine_gpu_ids
from miles_control.job.runtime.answers import Evaluated, TakenBatch
from miles_control.job.runtime.node import node_id, pin_to, repin
from miles_control.job.runtime.usage import ProcessUsage, prefixed
from miles_rollout.protocol import ReleasesMemory
from miles_rollout.push import Landed, land
from miles_sync import WeightHandle

if TYPE_CHECKING:
    from miles_control.job.runtime.buffer import StalenessBuffer


class RolloutWorker:
    """Owns the engine, the tokenizer, the rollout manager and the prompt streams."""

    def __init__(
        self,
        spec: dict[str, Any],
        model_path: str,
        train_prompts: list,
        eval_prompts: list,
        cpus: list[int] | None = None,
        plan: Plan | None = None,
        engine_gpus: list[list[str]] | None = None,
    ) -> None:
        """`plan`: the job's resource plan; `engine_gpus`: each SGLang server's GPUs when the plan assigns them
        from outside this actor (colocated: the trainer ranks'); else they come from the GPUs Ray gave it."""
        self._usage = ProcessUsage()
        import ray
        import torch
        from transformers import AutoConfig

        from miles_control.spec.config import JobSpec
        from miles_rollout import RolloutManager, build_engine
        from miles_rollout.data import PromptStream
        from miles_rollout.prompts import load_encoder

        job = JobSpec.model_validate(spec)
        self.config = job.rollout
        # Ray limits an actor to its fractional CPU share; in the sync schedule rollout has the machine.
        torch.set_num_threads(os.cpu_count() or 1)
        pin_to(cpus)  # before the engine starts: SGLang servers inherit the cores
        packed = job.sync.quantization if job.sync.quant_wire == "packed" else None
        if engine_gpus is None and plan is not None and plan.gpus_per_engine:
            engine_gpus = engine_gpu_ids(plan, [str(gpu) for gpu in ray.get_gpu_ids()])
        self.engine_gpus = engine_gpus
        engine_config = job.rollout.engine
        if plan is not None and plan.mode == "colocated":
            engine_config = engine_config.as_colocated()  # what the engine needs to release its memory
        lora = job.train.lora.peft_kwargs() if job.train.lora is not None and job.sync.lora == "adapter" else None
        self.engine = build_engine(
            engine_config, Path(model_path), seed=job.seed, packed=packed, gpu_ids=engine_gpus, lora=lora
        )
        encoder = load_encoder(model_path, job.data.chat_template, job.data.system_prompt)
        tokenizer = encoder.tokenizer
        hf_config = AutoConfig.from_pretrained(model_path)
        vocab_size = getattr(hf_config, "vocab_size", None) or getattr(hf_config.get_text_config(), "vocab_size", None)
        self.manager = RolloutManager(self.engine, tokenizer, job.rollout, encoder, vocab_size=vocab_size)
        attach = getattr(self.manager.reward_fn, "attach", None)  # a judge of `model: policy` reads the job's model
        if callable(attach):
            attach(Path(model_path), job.seed)
        self.stream = PromptStream(train_prompts, seed=job.seed)
        self.eval_prompts = eval_prompts[: job.rollout.eval.num_prompts]
        # fully_async's continuous generation (start_stream): the buffer, and what the thread hands to take()
        self.buffer: StalenessBuffer | None = None
        self._thread: threading.Thread | None = None
        self._running = threading.Event()
        self._regenerate: list = []  # prompts of groups dropped for staleness under stale_policy: regenerate
        self._timings: list = []
        self._sampling = None  # of the generated batches: the taken batch says how its samples were sampled
        self._stream_error: BaseException | None = None
        self._next_group = 0
        self._counts: dict[str, float] = {}  # fully_async: generate_step's counts since the last take
        self._counts_lock = threading.Lock()
        self._fresh_drawn = 0  # prompts taken from the stream (regenerated ones once), for prompts_drawn
        # schedule.push_between_batches: a push waits for the batch being generated to end, and the next batch waits
        # for the push (a batch: generate()'s step, or one call of fully_async's stream)
        self._gate = threading.Condition()
        self._batches_running = 0
        self._pushes_waiting = 0

    def receiver_ranks(self) -> int:
        """Ranks the engine brings to a collective weight push."""
        return self.engine.receiver_ranks()

    def node_id(self) -> str:
        """The Ray node this actor runs on."""
        return node_id()

    def repin(self, cpus: list[int]) -> None:
        """This actor and its engine's servers on `cpus` from now on (the cost-following CPU split)."""
        repin(cpus)

    def usage(self) -> dict[str, float]:
        """This actor's CPU and memory with its engines' (SGLang servers are its children) since the last call."""
        return prefixed("rollout", self._usage.sample())

    def engine_restarts(self) -> list:
        """The engine's servers restarted since the last call (SGLang's router restarts one whose process is gone;
        `miles_rollout.engines.sglang.recovery.EngineRestart`), for the driver's recorder. An engine that restarts
        nothing has none."""
        take = getattr(self.engine, "take_restarts", None)
        return take() if take is not None else []

    def _releasing(self) -> ReleasesMemory:
        if not isinstance(self.engine, ReleasesMemory):  # the spec refuses colocation for such an engine
            raise TypeError(f"the {self.engine.name} engine cannot release its GPU memory (resources.mode: colocated)")
        return self.engine

    def release_memory(self) -> None:
        """Colocated mode (an engine that `releases_memory`, checked by the spec): free the engines' GPU memory for
        the trainer."""
        self._releasing().release_memory()

    def resume_memory(self) -> None:
        """Colocated mode: the engines take their GPU memory back before the next push."""
        self._releasing().resume_memory()

    def skip_prompts(self, num_prompts: int) -> None:
        """Advance the prompt stream past what earlier steps used (a resume continues where they stopped)."""
        if num_prompts:
            self.stream.next_batch(num_prompts)

    def _draw(self, num_prompts: int) -> list:
        """Prompts to generate from: those the fully_async buffer gave back for regeneration first, then the stream."""
        take = min(num_prompts, len(self._regenerate))
        prompts = [self._regenerate.pop(0) for _ in range(take)]
        fresh = self.stream.next_batch(num_prompts - take)
        self._fresh_drawn += len(fresh)  # a regenerated prompt was counted when first drawn
        return prompts + fresh

    @contextmanager
    def _batch(self, min_version: int = 0, timeout_s: float = 1800.0) -> Iterator[None]:
        """Generating one batch: starts once the batch before it ended, no push waits for the batches to end and the
        engine holds weight version `min_version` or newer (one_step_off asks for a step's batch a step ahead, before
        the push it needs has landed)."""
        with self._gate:
            ready = self._gate.wait_for(
                lambda: (
                    self._batches_running == 0
                    and self._pushes_waiting == 0
                    and self.engine.weight_version >= min_version
                ),
                timeout=timeout_s,
            )
            if not ready:
                raise TimeoutError(
                    f"generate: the engine still holds weight version {self.engine.weight_version} after "
                    f"{timeout_s:.0f} s, not {min_version} (did the push fail?)"
                )
            self._batches_running += 1
        try:
            yield
        finally:
            with self._gate:
                self._batches_running -= 1
                self._gate.notify_all()

    @contextmanager
    def _between_batches(self) -> Iterator[tuple[float, float]]:
        """Wait for the batch under way to end and hold the next one back until the block ends; yields when the
        wait began and ended."""
        began = time.time()
        with self._gate:
            self._pushes_waiting += 1
            self._gate.wait_for(lambda: self._batches_running == 0)
        try:
            yield began, time.time()
        finally:
            with self._gate:
                self._pushes_waiting -= 1
                self._gate.notify_all()

    def generate(self, min_version: int = 0):
        """One step's batch (`rollout.dynamic_sampling`: its informative groups); `batch.metrics` has what it took.
        It starts once the engine holds weight version `min_version` (a push between batches may not have landed)."""
        with self._batch(min_version):
            batch, _ = asyncio.run(self.manager.generate_step(self._draw, self.config.num_prompts_per_step))
        return batch

    def _stream_drawn(self) -> float:
        """Fresh prompts drawn since the last call (what a checkpoint adds to where the stream stands)."""
        drawn, self._fresh_drawn = self._fresh_drawn, 0
        return float(drawn)

    # ---- fully_async: continuous generation into a bounded buffer -------------------------------

    def start_stream(self, capacity: int, chunk_prompts: int) -> None:
        """Generate continuously, `chunk_prompts` prompts per call, into a buffer of `capacity` groups."""
        from miles_control.job.runtime.buffer import StalenessBuffer

        if self._thread is not None:
            raise RuntimeError("start_stream: the stream already runs")
        self.buffer = StalenessBuffer(capacity)
        self._regenerate, self._timings, self._sampling = [], [], None
        self._stream_error, self._next_group = None, 0
        self._running.set()
        self._thread = threading.Thread(target=self._stream, args=(chunk_prompts,), daemon=True, name="rollout")
        self._thread.start()

    def _stream(self, chunk_prompts: int) -> None:
        from miles_control.job.runtime.buffer import Group

        assert self.buffer is not None
        try:
            while self._running.is_set():
                with self._batch():
                    batch, prompts = asyncio.run(self.manager.generate_step(self._draw, chunk_prompts))
                batch.metrics["rollout/prompts_drawn"] = self._stream_drawn()  # regenerated prompts not again
                self._timings += batch.timings
                self._sampling = batch.sampling
                with self._counts_lock:  # take() swaps the counts out from another thread
                    for key, value in batch.metrics.items():  # counts since the last take
                        self._counts[key] = self._counts.get(key, 0.0) + value
                by_group: dict[int, list] = {}
                for sample in batch.samples:
                    by_group.setdefault(sample.group_index, []).append(sample)
                for index, samples in by_group.items():
                    versions = sorted({v for s in samples for v in s.weight_versions})
                    group = Group(self._next_group, prompts[index], samples, versions, time.time())
                    self._next_group += 1
                    while self._running.is_set() and not self.buffer.put(group, timeout=0.2):
                        pass
        except BaseException as exc:  # reported to the trainer by take()
            self._stream_error = exc

    def take(
        self, num_groups: int, trainer_version: int, max_staleness: int, policy: str, timeout_s: float
    ) -> TakenBatch:
        """`num_groups` fresh groups as one RolloutBatch, their staleness per sample, and what was discarded."""
        from miles_rollout.types import RolloutBatch, StageTiming

        if self.buffer is None:
            raise RuntimeError("take: start_stream first")
        start = time.time()
        taken = self.buffer.take(num_groups, trainer_version, max_staleness, policy, timeout=0.0)
        groups = list(taken.groups)
        dropped, regenerate = len(taken.dropped), len(taken.regenerate)
        self._regenerate += [g.prompt for g in taken.regenerate]
        deadline = start + timeout_s
        while len(groups) < num_groups:
            if self._stream_error is not None:
                raise RuntimeError(f"rollout generation failed: {self._stream_error}") from self._stream_error
            if time.time() > deadline:
                raise TimeoutError(f"fully_async: fewer than {num_groups} fresh groups after {timeout_s:.0f} s")
            more = self.buffer.take(num_groups - len(groups), trainer_version, max_staleness, policy, timeout=0.5)
            groups += more.groups
            dropped, regenerate = dropped + len(more.dropped), regenerate + len(more.regenerate)
            self._regenerate += [g.prompt for g in more.regenerate]
        samples, staleness = [], []
        for new_index, group in enumerate(groups):
            for sample in group.samples:
                sample.group_index = new_index
                samples.append(sample)
                staleness.append(sample.staleness(trainer_version))
        timings, self._timings = self._timings, []
        with self._counts_lock:
            counts, self._counts = self._counts, {}
        batch = RolloutBatch(
            samples,
            timings=[*timings, StageTiming("wait_rollout", start, time.time())],
            sampling=self._sampling,
            metrics=counts,
        )
        return TakenBatch(batch, staleness, dropped, regenerate, len(self.buffer))

    def resize_buffer(self, capacity: int) -> None:
        """fully_async: a new buffer capacity in groups (`schedule.buffer_groups`, changed while the job runs)."""
        if self.buffer is None:
            raise RuntimeError("resize_buffer: start_stream first")
        self.buffer.resize(capacity)

    def stop_stream(self) -> None:
        """fully_async: stop generating (the chunk under way ends first)."""
        if self._thread is not None:
            self._running.clear()
            self._thread.join(timeout=120)
            self._thread = None

    def evaluate(self, min_version: int = 0, timeout_s: float = 1800.0) -> Evaluated:
        """Held-out accuracy on the eval prompts, at `rollout.eval.temperature`, once the engine holds weight version
        `min_version` or newer (a push between batches may land after the evaluation was asked for)."""
        with self._gate:
            if not self._gate.wait_for(lambda: self.engine.weight_version >= min_version, timeout=timeout_s):
                raise TimeoutError(
                    f"evaluate: the engine still holds weight version {self.engine.weight_version} after "
                    f"{timeout_s:.0f} s, not {min_version} (did the push fail?)"
                )
        start = time.time()
        metrics = asyncio.run(self.manager.evaluate(self.eval_prompts, self.config.eval.temperature))
        return Evaluated(start, time.time(), metrics)

    def receive_weights(
        self,
        handle: WeightHandle,
        pause_mode: str = "in_place",
        check_after_resume: bool = False,
        between_batches: bool = False,
    ) -> Landed:
        """pause → load (bucketed) → take the new version → resume. Returns the engine's fingerprint. With
        `check_after_resume` the engine's check (its fingerprint against the trainer's; SGLang: every server's
        checksums too) runs once generation has resumed, and a failed one rolls the engine back to the version it
        held before (paused again for that). With `between_batches` the push first waits for the batch under way
        to end, and the next batch starts after it: nothing of a batch is in flight while the engine loads."""
        if not between_batches:
            return self._receive(handle, pause_mode, check_after_resume)
        with self._between_batches() as waited:
            received = self._receive(handle, pause_mode, check_after_resume)
        received.start = waited[0]
        received.waited = waited
        received.phases["wait_batch"] = waited[1] - waited[0]
        return received

    def _receive(self, handle: WeightHandle, pause_mode: str, check_after_resume: bool) -> Landed:
        return land(self.engine, handle, pause_mode, check_after_resume)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        """Stop the stream, the engine (its servers), a judge's engine and the OpenEnv servers this process started."""
        self.stop_stream()
        self.engine.shutdown()
        judge_shutdown = getattr(self.manager.reward_fn, "shutdown", None)
        if callable(judge_shutdown):
            judge_shutdown()
        if "miles_rollout.hubs.openenv_env" in sys.modules:
            from miles_rollout.hubs.openenv_env import stop_servers

            stop_servers()
