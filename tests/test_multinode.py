"""Several Ray nodes: a cluster of two raylets on this machine (Ray's own `cluster_utils.Cluster`: a head and a
worker node, each a separate raylet with its own custom resource), the trainer placed on one by
`resources.trainer_node`, the engine on the other by `resources.rollout_node`, weights pushed between them by
`broadcast` over TCP (gloo)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_demo import check_weight_syncs, miles_run  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def two_nodes():
    cluster_utils = pytest.importorskip("ray.cluster_utils")
    cluster = cluster_utils.Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"trainer": 1}, "include_dashboard": False}
    )
    worker = cluster.add_node(num_cpus=1, resources={"rollout": 1})
    cluster.wait_for_nodes()
    try:
        yield cluster, worker
    finally:
        cluster.shutdown()


def test_trainer_and_engine_on_two_nodes_push_weights_over_the_network(tmp_path, two_nodes):
    cluster, worker = two_nodes
    _, store = miles_run(
        tmp_path,
        f"ray.address={cluster.address}",
        "resources.trainer_node={trainer: 1}",
        "resources.rollout_node={rollout: 1}",
        "rollout.engine.type=hf",
        "sync.transport=broadcast",
        "schedule.num_steps=3",
        "rollout.num_prompts_per_step=8",
        "rollout.eval.num_prompts=20",
        "rollout.eval.every_steps=0",
    )
    assert store.job(1).status == "succeeded", store.job(1).error
    (nodes,) = [e for e in store.events(1) if e.kind == "nodes"]
    assert nodes.data["trainer"] == [cluster.head_node.node_id]
    assert nodes.data["rollout"] == worker.node_id
    check_weight_syncs(store, 1, 3)
    assert {s.attrs["transport"] for s in store.spans(1, "weight_sync")} == {"broadcast"}
