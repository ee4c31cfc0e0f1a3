"""The resource plan: the job's `resources:` turned into Ray placement, checked against the cluster before
anything starts.

- **Trainer**: one placement group, a bundle per rank (`ray.trainer_cpus_per_rank` CPUs,
  `resources.trainer_gpus_per_rank` GPUs, the `resources.trainer_node` custom resources, `trainer_labels`);
  each rank is an actor on its bundle holding those GPUs (Ray sets its `CUDA_VISIBLE_DEVICES`).
- **Rollout**: one actor that runs the engine. *disaggregated*: it holds `num_engines × rollout_gpus_per_engine`
  GPUs of its own and gives each SGLang server its share, in order. *colocated*: it holds none and runs in the
  trainer's first bundle (same node); the servers get the trainer ranks' GPUs, and release their memory while
  the trainer steps. Colocated jobs therefore run on one node.
- Each SGLang server runs with `CUDA_VISIBLE_DEVICES` set to its GPUs and `--base-gpu-id 0 --tp-size N`
  (`miles_rollout.engines.sglang.server.server_command`).
- The engine config answers how many engines run and how many GPUs each holds (`num_engines`,
  `gpus_per_engine`): the planner names no engine type.

On a cluster without GPUs (`auto` everywhere) the plan is CPU-only: the same bundles as before plans existed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles_control.spec.config import JobSpec

PLACEMENT_TIMEOUT_S = 300.0


class PlanError(ValueError):
    """A plan the cluster cannot hold (or a mode it cannot run); the message names what is missing."""


@dataclass(frozen=True)
class Plan:
    mode: str
    world_size: int
    trainer_cpus: float
    trainer_gpus: int  # per rank
    trainer_node: dict[str, float] = field(default_factory=dict)
    trainer_labels: dict[str, str] = field(default_factory=dict)
    rollout_cpus: float = 0.0
    rollout_gpus: int = 0  # the rollout actor's own (disaggregated)
    rollout_node: dict[str, float] = field(default_factory=dict)
    rollout_labels: dict[str, str] = field(default_factory=dict)
    num_engines: int = 1
    gpus_per_engine: int = 0

    @property
    def trainer_bundles(self) -> list[dict[str, float]]:
        bundle: dict[str, float] = {"CPU": self.trainer_cpus, **self.trainer_node}
        if self.trainer_gpus:
            bundle["GPU"] = self.trainer_gpus
        return [dict(bundle) for _ in range(self.world_size)]

    @property
    def total_gpus(self) -> int:
        return self.world_size * self.trainer_gpus + self.rollout_gpus

    def describe(self) -> str:
        trainer = f"{self.world_size} trainer rank(s) × {self.trainer_gpus} GPU"
        if self.mode == "colocated":
            rollout = f"{self.num_engines} engine(s) × {self.gpus_per_engine} GPU on the trainer's GPUs"
        else:
            rollout = f"{self.num_engines} engine(s) × {self.gpus_per_engine} GPU"
        return f"{self.mode}: {trainer}, {rollout} ({self.total_gpus} GPU(s) in all)"


def make_plan(spec: JobSpec, cluster: dict[str, float], fit: bool = True) -> Plan:
    """The plan of `spec` on a cluster with these total resources (`ray.cluster_resources()`); raises PlanError
    naming what does not fit (with `fit=False`, only a mode the cluster cannot run: the caller checks the rest)."""
    res, engine = spec.resources, spec.rollout.engine
    has_gpus = cluster.get("GPU", 0) > 0
    world = spec.train.backend.world_size
    trainer_gpus = (1 if has_gpus else 0) if res.trainer_gpus_per_rank == "auto" else res.trainer_gpus_per_rank
    num_engines = engine.num_engines
    per_engine = engine.gpus_per_engine(res.rollout_gpus_per_engine, has_gpus)
    plan = Plan(
        mode=res.mode,
        world_size=world,
        trainer_cpus=spec.ray.trainer_cpus_per_rank,
        trainer_gpus=trainer_gpus,
        trainer_node=dict(res.trainer_node),
        trainer_labels=dict(res.trainer_labels),
        rollout_cpus=spec.ray.rollout_cpus,
        rollout_gpus=0 if res.mode == "colocated" else num_engines * per_engine,
        rollout_node=dict(res.rollout_node),
        rollout_labels=dict(res.rollout_labels),
        num_engines=num_engines,
        gpus_per_engine=per_engine,
    )
    if res.mode == "colocated" and (not has_gpus or trainer_gpus != 1 or per_engine == 0):
        raise PlanError(
            "resources.mode: colocated shares GPUs between the trainer and the engines, and this job has none "
            f"(cluster GPUs: {cluster.get('GPU', 0):g}, trainer GPUs per rank: {trainer_gpus}, GPUs per engine: "
            f"{per_engine}); use resources.mode: disaggregated"
        )
    if fit:
        check_fits(plan, cluster)
    return plan


def check_gpus(plan: Plan, gpus: float, where: str = "the cluster") -> None:
    """Refuse a plan that needs more GPUs than `where` has."""
    if plan.total_gpus > gpus:
        parts = f"trainer {plan.world_size} × {plan.trainer_gpus}"
        if plan.rollout_gpus:
            parts += f" + rollout {plan.num_engines} engine(s) × {plan.gpus_per_engine}"
        raise PlanError(
            f"resources: the plan needs {plan.total_gpus} GPU(s) ({parts}) but {where} has {gpus:g}; lower "
            "train.backend.world_size, rollout.engine.num_engines or the resources.* GPU counts"
        )


def check_fits(plan: Plan, cluster: dict[str, float]) -> None:
    """Refuse a plan whose totals exceed the cluster's: GPUs, CPUs and every custom resource it names."""
    check_gpus(plan, cluster.get("GPU", 0))
    cpus = plan.world_size * plan.trainer_cpus + plan.rollout_cpus
    if cpus > cluster.get("CPU", 0):
        raise PlanError(
            f"ray: the plan needs {cpus:g} CPUs (trainer {plan.world_size} × {plan.trainer_cpus:g} + rollout "
            f"{plan.rollout_cpus:g}) but the cluster has {cluster.get('CPU', 0):g}"
        )
    needs: dict[str, float] = {}
    for name, amount in plan.trainer_node.items():
        needs[name] = needs.get(name, 0) + plan.world_size * amount
    for name, amount in plan.rollout_node.items():
        needs[name] = needs.get(name, 0) + amount
    for name, amount in needs.items():
        if amount > cluster.get(name, 0):
            section = "resources.trainer_node" if name in plan.trainer_node else "resources.rollout_node"
            raise PlanError(
                f"{section}: the plan needs {amount:g} of Ray resource {name!r} but the cluster has "
                f"{cluster.get(name, 0):g} (nodes declare it with `ray start --resources`)"
            )


def trainer_placement(plan: Plan) -> Any:
    """The trainer's placement group (ready): one bundle per rank, on one node when colocated."""
    import ray
    from ray.util.placement_group import placement_group

    labels = [dict(plan.trainer_labels) for _ in range(plan.world_size)] if plan.trainer_labels else None
    strategy = "STRICT_PACK" if plan.mode == "colocated" else "PACK"
    group = placement_group(plan.trainer_bundles, strategy=strategy, bundle_label_selector=labels)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)
        raise PlanError(
            f"resources: Ray could not place the trainer's bundles {plan.trainer_bundles} "
            f"(labels {plan.trainer_labels or 'none'}) within {PLACEMENT_TIMEOUT_S:g} s: no node (or set of nodes) "
            "holds them free"
        ) from None
    return group


def trainer_rank_options(plan: Plan, group: Any, rank: int) -> dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "num_cpus": plan.trainer_cpus,
        "num_gpus": plan.trainer_gpus,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
    }


def rollout_options(plan: Plan, trainer_group: Any | None = None) -> dict[str, Any]:
    """Ray options of the rollout actor: its own GPUs and node (disaggregated), or the trainer's first bundle
    (colocated: `trainer_group` is needed)."""
    options: dict[str, Any] = {"num_cpus": plan.rollout_cpus, "num_gpus": plan.rollout_gpus}
    if plan.mode == "colocated":
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if trainer_group is None:
            raise ValueError("colocated rollout is placed in the trainer's placement group: pass it")
        # The bundle's CPUs belong to rank 0; the actor mostly waits on its servers.
        options["num_cpus"] = 0
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(trainer_group, placement_group_bundle_index=0)
        return options
    if plan.rollout_node:
        options["resources"] = dict(plan.rollout_node)
    if plan.rollout_labels:
        options["label_selector"] = dict(plan.rollout_labels)
    return options


def engine_gpu_ids(plan: Plan, visible: list[str]) -> list[list[str]] | None:
    """Each SGLang server's GPUs, from the GPU ids the rollout side may use (its own, or the trainer ranks' when
    colocated), in order; None on a CPU-only plan."""
    if plan.gpus_per_engine == 0:
        return None
    need = plan.num_engines * plan.gpus_per_engine
    if len(visible) < need:
        raise PlanError(
            f"resources: {plan.num_engines} engine(s) × {plan.gpus_per_engine} GPU(s) need {need} GPU ids but the "
            f"rollout side was given {len(visible)} ({visible})"
        )
    return [visible[i * plan.gpus_per_engine : (i + 1) * plan.gpus_per_engine] for i in range(plan.num_engines)]
