"""TrainerGroup: every rank of the trainer as Ray actors on the plan's placement group; each call runs on all
ranks and returns rank 0's answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_control.job.placement import Plan, make_plan, trainer_placement, trainer_rank_options
from miles_control.job.runtime.workers import Published, TrainerWorker, TrainResult, free_port_and_ip
from miles_control.spec.config import JobSpec


class TrainerGroup:
    """All ranks of the trainer; each call runs on every rank and returns rank 0's answer."""

    def __init__(
        self,
        spec: JobSpec,
        model_path: Path,
        weights_dir: Path,
        receiver_ranks: int = 1,
        pin_cpus: list[int] | None = None,
        pushed_precision: str = "float32",
        plan: Plan | None = None,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world_size = spec.train.backend.world_size
        plan = plan or make_plan(spec, ray.cluster_resources())
        self.placement_group = trainer_placement(plan)

        def on_bundle(index: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=index)

        ip, port = ray.get(ray.remote(free_port_and_ip).options(num_cpus=0, scheduling_strategy=on_bundle(0)).remote())
        actor = ray.remote(TrainerWorker)
        spec_dict = spec.model_dump(mode="json")
        if spec.train.teacher is not None:  # as the driver sees it: a rank's working folder may be another
            spec_dict["train"]["teacher"] = str(Path(spec.train.teacher).resolve())
        self.ranks = [
            actor.options(**trainer_rank_options(plan, self.placement_group, rank), name=None).remote(
                spec_dict,
                str(model_path),
                rank,
                world_size,
                f"tcp://{ip}:{port}",
                str(weights_dir),
                receiver_ranks,
                pin_cpus,
                pushed_precision,
            )
            for rank in range(world_size)
        ]

    def repin(self, cpus: list[int]) -> None:
        """Every rank to `cpus` from now on."""
        import ray

        ray.get([rank.repin.remote(cpus) for rank in self.ranks])

    def node_ids(self) -> list[str]:
        """The Ray node of each rank, in rank order."""
        import ray

        return ray.get([rank.node_id.remote() for rank in self.ranks])

    def gpu_ids(self) -> list[str]:
        """The GPU ids Ray gave the ranks, in rank order (empty on CPU)."""
        import ray

        return [gpu for ids in ray.get([rank.gpu_ids.remote() for rank in self.ranks]) for gpu in ids]

    def _on_every_rank(self, call: Any) -> Any:
        """`call(rank)` returns an ObjectRef; all ranks run it (collectives inside), rank 0's answer is returned."""
        import ray

        return ray.get([call(rank) for rank in self.ranks])[0]

    def train_step(self, batch: Any) -> TrainResult:
        """Rank 0's result, with every rank's resource usage (`sys/trainer<r>/...`)."""
        import ray

        results = ray.get([rank.train_step.remote(batch) for rank in self.ranks])
        for other in results[1:]:
            results[0].metrics.update({k: v for k, v in other.metrics.items() if k.startswith("sys/")})
        return results[0]

    def publish_weights(self, weight_version: int) -> Published:
        """Every rank exports and publishes (rank 0 alone, or each rank what it holds); one handle for all."""
        import ray

        from miles_sync import combine

        published = ray.get([rank.publish_weights.remote(weight_version) for rank in self.ranks])
        handle = combine([p.handle for p in published])
        return Published(published[0].start, max(p.end for p in published), handle)

    def wait_published(self) -> None:
        self._on_every_rank(lambda rank: rank.wait_published.remote())

    def save(self, directory: Path) -> None:
        self._on_every_rank(lambda rank: rank.save.remote(str(directory)))

    def load(self, directory: Path) -> None:
        self._on_every_rank(lambda rank: rank.load.remote(str(directory)))

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.get([rank.shutdown.remote() for rank in self.ranks], timeout=30)
        finally:
            for rank in self.ranks:
                ray.kill(rank)
            remove_placement_group(self.placement_group)
