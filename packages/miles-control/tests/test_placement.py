"""The resource plan (`resources:`): the planner against cluster totals, the spec's refusals, the SGLang command
line each engine gets, and Ray's GPU assignment to the runtime's own placement options on a Ray instance started
with logical GPUs (this machine has none: Ray hands out GPU ids and sets CUDA_VISIBLE_DEVICES all the same)."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from miles_control.job.placement import (
    PlanError,
    engine_gpu_ids,
    make_plan,
    rollout_options,
    trainer_placement,
    trainer_rank_options,
)
from miles_control.spec.config import JobSpec
from miles_rollout.config import SGLangEngineConfig
from miles_rollout.engines.sglang.server import server_command


def spec(world: int = 2, engines: int = 1, tp: int = 1, **fields) -> JobSpec:
    extra = ["--tp-size", str(tp)] if tp > 1 else []
    return JobSpec.model_validate(
        {
            "name": "p",
            "rollout": {"engine": {"type": "sglang", "num_engines": engines, "extra_args": extra}},
            "train": {"backend": {"type": "fsdp2", "world_size": world}},
            **fields,
        }
    )


def test_without_gpus_the_plan_is_cpu_only_as_before():
    plan = make_plan(spec(), {"CPU": 2.0})
    assert plan.trainer_bundles == [{"CPU": 0.5}, {"CPU": 0.5}]
    assert (plan.trainer_gpus, plan.rollout_gpus, plan.gpus_per_engine) == (0, 0, 0)
    assert engine_gpu_ids(plan, []) is None


def test_gpus_are_planned_per_rank_and_per_engine():
    plan = make_plan(spec(world=2, engines=2, tp=2), {"CPU": 16.0, "GPU": 8.0})
    assert plan.trainer_bundles == [{"CPU": 0.5, "GPU": 1}, {"CPU": 0.5, "GPU": 1}]
    assert (plan.rollout_gpus, plan.gpus_per_engine, plan.total_gpus) == (4, 2, 6)
    assert engine_gpu_ids(plan, ["4", "5", "6", "7"]) == [["4", "5"], ["6", "7"]]
    assert "disaggregated: 2 trainer rank(s) × 1 GPU, 2 engine(s) × 2 GPU (6 GPU(s) in all)" == plan.describe()


def test_a_plan_the_cluster_cannot_hold_names_what_is_missing():
    with pytest.raises(PlanError, match=r"needs 6 GPU\(s\) \(trainer 2 × 1 \+ rollout 2 engine\(s\) × 2\) .* has 4"):
        make_plan(spec(world=2, engines=2, tp=2), {"CPU": 16.0, "GPU": 4.0})
    with pytest.raises(PlanError, match="resources.rollout_node: .* 'rollout_node' but the cluster has 0"):
        make_plan(spec(resources={"rollout_node": {"rollout_node": 1}}), {"CPU": 4.0})
    with pytest.raises(PlanError, match="ray: the plan needs 3 CPUs"):
        make_plan(spec(ray={"trainer_cpus_per_rank": 1, "rollout_cpus": 1}), {"CPU": 2.0})
    with pytest.raises(PlanError, match=r"colocated shares GPUs .* \(cluster GPUs: 0"):
        make_plan(spec(world=1, resources={"mode": "colocated"}, sync={"transport": "tensor"}), {"CPU": 4.0})


def test_the_spec_refuses_resources_that_cannot_work():
    with pytest.raises(ValidationError, match=r"rollout_gpus_per_engine: 4 is not .* --tp-size × --dp-size .* = 2"):
        spec(tp=2, resources={"rollout_gpus_per_engine": 4})
    colocated = {"resources": {"mode": "colocated"}, "sync": {"transport": "tensor"}}
    with pytest.raises(ValidationError, match="colocated does not work with sync.transport: broadcast"):
        spec(resources={"mode": "colocated"}, sync={"transport": "broadcast"})
    with pytest.raises(ValidationError, match="colocated does not work with schedule.type: one_step_off"):
        spec(**colocated, schedule={"type": "one_step_off"})
    with pytest.raises(ValidationError, match="colocated does not work with sync.delta: True: the engines release"):
        spec(resources={"mode": "colocated"}, sync={"transport": "tensor", "delta": True})
    with pytest.raises(ValidationError, match=r"1 engine\(s\) × 1 GPU\(s\) must equal train.backend.world_size \(2"):
        spec(world=2, engines=1, **colocated)
    with pytest.raises(ValidationError, match="colocated does not work with rollout.engine.type: hf"):
        JobSpec.model_validate({"name": "p", "rollout": {"engine": {"type": "hf"}}, **colocated})
    assert spec(world=2, engines=2, **colocated).resources.mode == "colocated"


def test_each_sglang_server_is_told_its_gpus():
    config = SGLangEngineConfig(type="sglang", device="cuda", extra_args=["--tp-size", "2"])
    args, env = server_command("/m", config, "bfloat16", 30000, 7, ["6", "7"])
    assert env == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert args[args.index("--base-gpu-id") + 1] == "0" and args[args.index("--tp-size") + 1] == "2"
    assert "--device" not in args
    cpu_args, cpu_env = server_command("/m", SGLangEngineConfig(type="sglang", device="cpu"), "float32", 1, 0)
    assert cpu_args[cpu_args.index("--device") + 1] == "cpu" and "CUDA_VISIBLE_DEVICES" not in cpu_env


@pytest.fixture
def ray_with_logical_gpus():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, num_gpus=4, include_dashboard=False, resources={"trainer_node": 2})
    yield ray
    ray.shutdown()


def visible(ray, options: dict) -> list[str]:
    """CUDA_VISIBLE_DEVICES inside an actor started with the runtime's options for it."""

    @ray.remote
    class Probe:
        def devices(self) -> str:
            return os.environ.get("CUDA_VISIBLE_DEVICES", "")

    actor = Probe.options(**options).remote()
    try:
        value = ray.get(actor.devices.remote())
    finally:
        ray.kill(actor)
    return [gpu for gpu in value.split(",") if gpu]


@pytest.mark.slow
def test_ray_gives_each_rank_and_engine_the_planned_gpus(ray_with_logical_gpus):
    ray = ray_with_logical_gpus
    cluster = ray.cluster_resources()
    # disaggregated: two ranks with one GPU each, one engine with two (tp 2): four distinct GPUs
    plan = make_plan(spec(world=2, tp=2, resources={"trainer_node": {"trainer_node": 1}}), cluster)
    assert plan.trainer_bundles[0] == {"CPU": 0.5, "trainer_node": 1, "GPU": 1}
    group = trainer_placement(plan)
    try:
        ranks = [visible(ray, trainer_rank_options(plan, group, r)) for r in range(2)]
        rollout = visible(ray, rollout_options(plan))
    finally:
        ray.util.remove_placement_group(group)
    assert [len(r) for r in ranks] == [1, 1] and len(rollout) == 2
    assert len(set(ranks[0] + ranks[1] + rollout)) == 4  # no GPU is shared
    assert engine_gpu_ids(plan, rollout) == [rollout]

    # colocated: two ranks, two engines of one GPU; the rollout actor holds none and runs beside rank 0, and
    # each engine gets one rank's GPU
    plan = make_plan(spec(world=2, engines=2, resources={"mode": "colocated"}, sync={"transport": "tensor"}), cluster)
    group = trainer_placement(plan)
    try:
        ranks = [visible(ray, trainer_rank_options(plan, group, r)) for r in range(2)]
        assert visible(ray, rollout_options(plan, group)) == []
    finally:
        ray.util.remove_placement_group(group)
    engines = engine_gpu_ids(plan, ranks[0] + ranks[1])
    assert engines == [ranks[0], ranks[1]] and ranks[0] != ranks[1]

    # a plan the cluster cannot hold fails before anything is placed
    with pytest.raises(PlanError, match=r"needs 6 GPU\(s\)"):
        make_plan(spec(world=2, engines=2, tp=2), cluster)
    assert ray.util.placement_group_table() == {} or all(
        entry["state"] == "REMOVED" for entry in ray.util.placement_group_table().values()
    )


def test_no_core_is_idle_by_design_cpu_split_applies_only_where_stages_overlap():
    """`ray.cpu_split` splits the machine between the trainer and the rollout only under the schedules where they run
    at once; under sync (they take turns) each stage keeps every core."""
    import os

    from miles_control.job.runtime.cpus import cpu_plan
    from miles_control.spec.config import JobSpec

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 CPU cores")
    for kind in ("sync", "one_step_off", "fully_async"):
        split = cpu_plan(JobSpec(name="x", schedule={"type": kind}, ray={"cpu_split": True}))
        if kind == "sync":
            assert split == {"trainer": None, "rollout": None}
        else:
            assert split["trainer"] and split["rollout"] and not set(split["trainer"]) & set(split["rollout"])
            assert sorted(split["trainer"] + split["rollout"]) == cores  # every core to one stage or the other
        assert cpu_plan(JobSpec(name="x", schedule={"type": kind})) == {"trainer": None, "rollout": None}


def test_the_split_follows_the_measured_stage_costs():
    """Under an overlapped schedule the halves give way to shares that make both stages take as long: a trainer
    that takes 3× the rollout's time on as many cores gets 3/4 of them; never fewer than one core each."""
    from miles_control.job.runtime.cpus import split_cpus, trainer_share

    sixteen = list(range(16))
    assert split_cpus(0.5, sixteen) == {"trainer": list(range(8)), "rollout": list(range(8, 16))}
    share = trainer_share(train_s=0.9, train_cores=8, rollout_s=0.3, rollout_cores=8)
    assert share == pytest.approx(0.75)
    assert split_cpus(share, sixteen) == {"trainer": list(range(12)), "rollout": list(range(12, 16))}
    # measured on unequal cores: 1 s on 12 cores is more work than 1 s on 4
    assert trainer_share(1.0, 12, 1.0, 4) == pytest.approx(0.75)
    assert split_cpus(0.99, sixteen)["rollout"] == [15] and split_cpus(0.0, sixteen)["trainer"] == [0]
    assert split_cpus(0.9, [0, 1]) == {"trainer": [0], "rollout": [1]}  # two cores: one each, whatever the costs
    assert trainer_share(0.0, 1, 0.0, 1) == 0.5  # nothing measured: halves
    with pytest.raises(ValueError, match="at least 2 CPU cores"):
        split_cpus(0.5, [3])


def test_repin_moves_a_process_its_threads_and_its_children():
    """The cost-following split moves a running actor: its own cores, torch's threads and its servers' cores."""
    import os
    import subprocess
    import sys

    import torch

    from miles_control.job.runtime.node import repin

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 CPU cores")
    threads = torch.get_num_threads()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        repin(cores[-1:])
        assert sorted(os.sched_getaffinity(0)) == cores[-1:] and torch.get_num_threads() == 1
        assert sorted(os.sched_getaffinity(child.pid)) == cores[-1:]
    finally:
        child.kill()
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
