"""The schedules' logic in milliseconds, without Ray: each schedule drives `FakeRuntime`, a stand-in for
`runtime.job.JobRuntime` (a fake: no engine, no trainer) that records in a real store and keeps the real
fully_async buffer. What it checks is the order of stages, the weight versions data was generated under,
the staleness the trainer sees, pushes, evaluations, live schedule changes and the stopping rules. The
real runtime runs the same schedules on Ray in tests/test_schedules.py and tests/test_demo.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from miles_control.job.recorder import Recorder
from miles_control.job.runtime.buffer import Group, StalenessBuffer
from miles_control.job.runtime.workers import Evaluated
from miles_control.job.schedules import SCHEDULES
from miles_control.service.store import Store
from miles_control.spec.config import JobSpec
from miles_rollout.types import RolloutBatch, Sample, SamplingParams


class FakeClock:
    """time.time() for the schedules: advances only when the fake trainer trains."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now


class FakeRuntime:
    """What a schedule calls on JobRuntime, in process. Generation makes samples tagged with the engine's
    weight version at the time it runs; training advances the clock by `train_s`."""

    def __init__(self, spec: JobSpec, store: Store, clock: FakeClock, train_s: float = 1.0) -> None:
        self.spec, self.clock, self.train_s = spec, clock, train_s
        self.recorder = Recorder(store, store.create_job(spec.name, spec.model_dump(mode="json")))
        self.weight_version = 0  # the engines'
        self.trainer_version = 0
        self.log: list[tuple] = []  # (what, step, details)
        self.buffer: StalenessBuffer | None = None
        self.groups_made = 0
        self.pending: int | None = None  # a push between batches not landed yet

    # ---- generation ---------------------------------------------------------------------------
    def _batch(self, num_prompts: int) -> RolloutBatch:
        samples = [
            Sample(g, "1+1=", "2", [3, 4], [5], [-0.5], [1], reward=float(g % 2), weight_versions=[self.weight_version])
            for g in range(num_prompts)
            for _ in range(self.spec.rollout.num_samples_per_prompt)
        ]
        return RolloutBatch(samples, sampling=SamplingParams(temperature=1.0))

    def generate(self, step: int):
        return self.collect(step, self.generate_async())

    def generate_async(self):
        self.settle_push()  # the rollout actor starts the batch once the last push landed (after the batch before)
        self.log.append(("generate", None, self.weight_version))
        return self._batch(self.spec.rollout.num_prompts_per_step)

    def collect(self, step: int, batch: RolloutBatch):
        return batch, {"rollout/reward_mean": sum(batch.rewards()) / len(batch.samples)}

    # ---- fully_async --------------------------------------------------------------------------
    def start_stream(self, capacity: int, chunk_prompts: int) -> None:
        self.buffer = StalenessBuffer(capacity)
        self.log.append(("start_stream", None, capacity))

    def _fill(self) -> None:
        """Generation ran since the last take: the buffer is full of groups of the current engine version."""
        assert self.buffer is not None
        self.settle_push()  # the stream's call under way ended: a push waiting for it lands
        while len(self.buffer) < self.buffer.capacity:
            samples = self._batch(1).samples
            self.buffer.put(Group(self.groups_made, "1+1=", samples, [self.weight_version], self.clock.now))
            self.groups_made += 1

    def take(self, step: int, num_groups: int, trainer_version: int, max_staleness: int, policy: str):
        assert self.buffer is not None
        taken = self.buffer.take(num_groups, trainer_version, max_staleness, policy)
        groups = taken.groups
        while len(groups) < num_groups:
            self._fill()
            more = self.buffer.take(num_groups - len(groups), trainer_version, max_staleness, policy)
            groups += more.groups
            taken.dropped += more.dropped
        samples = [s for g in groups for s in g.samples]
        staleness = [s.staleness(trainer_version) for s in samples]
        metrics = {"async/dropped_groups": float(len(taken.dropped)), "async/staleness_max": float(max(staleness))}
        return RolloutBatch(samples, sampling=SamplingParams()), staleness, metrics

    def resize_buffer(self, capacity: int) -> None:
        assert self.buffer is not None
        self.buffer.resize(capacity)
        self.log.append(("resize", None, capacity))

    def stop_stream(self) -> None:
        self.log.append(("stop_stream", None, None))

    # ---- training, weights, evaluation --------------------------------------------------------
    def train(self, step: int, batch: RolloutBatch, staleness: list[int] | None = None) -> dict[str, float]:
        versions = sorted({v for s in batch.samples for v in s.weight_versions})
        self.log.append(("train", step, {"versions": versions, "staleness": staleness}))
        self.clock.now += self.train_s
        self.trainer_version += 1
        return {"train/loss": 1.0 / step}

    def push_weights(
        self, step: int, version: int | None = None, pause_mode: str = "in_place", between_batches: bool = False
    ) -> dict[str, float]:
        self.settle_push()
        version = self.trainer_version if version is None else version
        self.log.append(("push", step, {"version": version, "pause_mode": pause_mode, "between": between_batches}))
        if between_batches:  # lands when the batch under way ends: at the next generation or settle_push
            self.pending = version
            return {}
        self.weight_version = version
        return {"sync/weight_version": float(version)}

    def settle_push(self, record: bool = True) -> dict[str, float]:
        if self.pending is None:
            return {}
        self.weight_version, self.pending = self.pending, None
        self.log.append(("landed", None, self.weight_version))
        return {"sync/weight_version": float(self.weight_version)}

    def evaluate(self, step: int) -> dict[str, float]:
        return self.record_eval(step, self.eval_result(self.evaluate_async(), True))

    def evaluate_async(self):  # on the last pushed version, as the rollout actor waits for it
        return SimpleNamespace(version=self.weight_version if self.pending is None else self.pending)

    def eval_result(self, ref, wait: bool) -> Evaluated:
        return Evaluated(self.clock.now, self.clock.now, {"eval/accuracy": min(1.0, 0.2 * ref.version)})

    def record_eval(self, step: int, result: Evaluated) -> dict[str, float]:
        self.log.append(("eval", step, result.metrics["eval/accuracy"]))
        return result.metrics

    def follow_stage_costs(self, step: int) -> None:
        self.log.append(("costs", step, None))  # the real one re-splits the cores once (job/runtime/cpus.py)

    def checkpoint_if_due(self, step: int) -> None:
        every = self.spec.schedule.checkpoint_every
        if every and step % every == 0:
            self.log.append(("checkpoint", step, None))

    # ---- reading the log ----------------------------------------------------------------------
    def of(self, what: str) -> list[tuple]:
        return [(step, details) for kind, step, details in self.log if kind == what]


@pytest.fixture
def clock(monkeypatch):
    clock = FakeClock()
    for module in ("common", "sync", "one_step_off", "fully_async"):
        monkeypatch.setattr(f"miles_control.job.schedules.{module}.time", clock)
    return clock


def run(
    tmp_path, clock, schedule: dict, eval_every: int = 0, before_step=None, train_s: float = 1.0, **spec
) -> tuple[FakeRuntime, int]:
    data = {"name": "fast", "schedule": {"num_steps": 6, **schedule}, **spec}
    data.setdefault("rollout", {"num_prompts_per_step": 2, "num_samples_per_prompt": 2})
    rt = FakeRuntime(JobSpec.model_validate(data), Store(f"sqlite:///{tmp_path}/m.db"), clock, train_s)
    steps: list[int] = []

    def on_step(step: int, metrics: dict) -> None:
        steps.append(step)
        if before_step is not None:
            before_step(rt, step + 1)

    last = SCHEDULES[rt.spec.schedule.type](rt, rt.spec.schedule, eval_every, on_step)
    assert steps == list(range(1, last + 1))
    return rt, last


def test_sync_trains_on_the_latest_weights_and_pushes_every_step(tmp_path, clock):
    rt, last = run(tmp_path, clock, {"type": "sync"}, eval_every=2)
    assert last == 6
    assert [d["versions"] for _, d in rt.of("train")] == [[v] for v in range(6)]  # generated under version k-1
    assert [d["version"] for _, d in rt.of("push")] == [1, 2, 3, 4, 5, 6]
    assert [step for step, _ in rt.of("eval")] == [0, 2, 4, 6]
    recorded = rt.recorder.store.steps(rt.recorder.job_id)
    assert [(s.step, s.weight_version) for s in recorded] == [(k, k) for k in range(1, 7)]


def test_one_step_off_trains_one_version_behind(tmp_path, clock):
    rt, _ = run(tmp_path, clock, {"type": "one_step_off"})
    # step 1 trains on data of version 0; every later step on data generated while the previous one trained
    assert [d["staleness"] for _, d in rt.of("train")] == [[0] * 4] + [[1] * 4] * 5
    assert [d["version"] for _, d in rt.of("push")] == [1, 2, 3, 4, 5, 6]
    assert len(rt.of("generate")) == 6  # the batch after the last step is not generated
    assert [step for step, _ in rt.of("costs")] == [1, 2, 3, 4, 5, 6]  # the CPU split may follow the costs each step


def test_one_step_off_takes_a_live_interval_change_at_the_next_step(tmp_path, clock):
    def change(rt: FakeRuntime, next_step: int) -> None:
        if next_step == 3:
            rt.recorder.store.request_schedule_change(rt.recorder.job_id, {"update_weights_interval": 2})

    rt, _ = run(tmp_path, clock, {"type": "one_step_off"}, before_step=change)
    # pushes after steps 1, 2, then every second version, and after the last step
    assert [step for step, _ in rt.of("push")] == [1, 2, 4, 6]
    [applied] = rt.recorder.store.schedule_changes(rt.recorder.job_id)
    assert applied.status == "applied" and applied.applied_step == 3
    assert max(s for _, d in rt.of("train") for s in d["staleness"]) == 2  # one push skipped: two versions behind


@pytest.mark.parametrize("policy", ["drop", "regenerate"])
def test_fully_async_never_trains_on_data_older_than_max_staleness(tmp_path, clock, policy):
    schedule = {"type": "fully_async", "max_staleness": 1, "stale_policy": policy, "buffer_groups": 6}
    rt, _ = run(tmp_path, clock, schedule)
    staleness = [s for _, d in rt.of("train") for s in d["staleness"]]
    assert max(staleness) == 1 and min(staleness) == 0  # the bound is reached and never passed
    dropped = rt.recorder.store.metric_series(rt.recorder.job_id, "async/dropped_groups")
    if policy == "drop":
        assert sum(v for _, v in dropped) > 0  # the buffer held groups that became too stale
    assert rt.of("stop_stream") and rt.of("start_stream") == [(None, 6)]


def test_a_live_buffer_change_resizes_the_buffer(tmp_path, clock):
    def change(rt: FakeRuntime, next_step: int) -> None:
        if next_step == 2:
            rt.recorder.store.request_schedule_change(rt.recorder.job_id, {"buffer_groups": 3})

    rt, _ = run(tmp_path, clock, {"type": "fully_async", "buffer_groups": 6}, before_step=change)
    assert rt.of("resize") == [(None, 3)] and rt.buffer is not None and rt.buffer.capacity == 3


@pytest.mark.parametrize("schedule", ["sync", "one_step_off", "fully_async"])
def test_max_minutes_stops_after_a_whole_step(tmp_path, clock, schedule):
    # 25 s of (fake) time per step: past one minute after the third step, which completes
    _, last = run(tmp_path, clock, {"type": schedule, "num_steps": 20, "max_minutes": 1.0}, train_s=25.0)
    assert last == 3


def test_stop_at_accuracy_ends_the_run_where_it_is_reached(tmp_path, clock):
    rt, last = run(tmp_path, clock, {"type": "sync", "stop_at_accuracy": 0.6, "num_steps": 20}, eval_every=1)
    assert last == 3  # the fake's accuracy is 0.2 × the engines' version
    assert rt.of("eval")[-1] == (3, pytest.approx(0.6))


def test_a_cancel_stops_before_the_next_step(tmp_path, clock):
    from miles_control.job.schedules.control import JobCancelled

    def cancel(rt: FakeRuntime, next_step: int) -> None:
        if next_step == 3:
            rt.recorder.store.request_cancel(rt.recorder.job_id)

    with pytest.raises(JobCancelled, match="stopped before step 3"):
        run(tmp_path, clock, {"type": "one_step_off"}, before_step=cancel)


def test_the_fake_clock_is_what_the_schedules_read(clock):
    from miles_control.job.schedules import common

    assert common.time.time() == clock.now != time.time()


def test_one_step_off_pushes_between_batches_by_default(tmp_path, clock):
    rt, _ = run(tmp_path, clock, {"type": "one_step_off"}, eval_every=2)
    assert all(d["between"] for _, d in rt.of("push"))
    # each push lands once the batch under way was collected, and the batch after it is generated on it
    order = [(kind, details if kind != "push" else details["version"]) for kind, _, details in rt.log]
    generated = [v for kind, v in order if kind == "generate"]
    assert generated == [0, 0, 1, 2, 3, 4]  # step k+2's batch on version k; step k+1's was under way
    for version in range(1, 5):  # the batches of steps 3..6
        landed = order.index(("landed", version))
        assert order.index(("push", version)) < landed < order.index(("generate", version))
    # evaluations asked for while a push waits run on the pushed version (the fake's accuracy: 0.2 × version)
    assert rt.of("eval") == [(0, 0.0), (2, pytest.approx(0.4)), (4, pytest.approx(0.8)), (6, pytest.approx(1.0))]


def test_one_step_off_can_push_at_once(tmp_path, clock):
    rt, _ = run(tmp_path, clock, {"type": "one_step_off", "push_between_batches": False})
    assert not any(d["between"] for _, d in rt.of("push")) and not rt.of("landed")
    assert [d["staleness"] for _, d in rt.of("train")] == [[0] * 4] + [[1] * 4] * 5


def test_fully_async_pushes_land_when_the_stream_call_ends(tmp_path, clock):
    schedule = {"type": "fully_async", "max_staleness": 1, "buffer_groups": 2}
    rt, _ = run(tmp_path, clock, schedule)
    assert all(d["between"] for _, d in rt.of("push")) and len(rt.of("landed")) == 6
    staleness = [s for _, d in rt.of("train") for s in d["staleness"]]
    assert max(staleness) <= 1
    assert rt.weight_version == 6  # the last step's push is settled before the schedule returns
