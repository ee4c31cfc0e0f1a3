"""Several Ray nodes: a cluster of two raylets on this machine (Ray's own `cluster_utils.Cluster`: a head and a
worker node, each a separate raylet with its own custom resource), the trainer placed on one by
`resources.trainer_node`, the engine on the other by `resources.rollout_node`, weights pushed between them by
`broadcast` over TCP (gloo)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_demo import ROOT, check_weight_syncs, miles_run  # noqa: E402

from miles_control.service.store import JobStatus, Store  # noqa: E402

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


def test_a_dead_node_fails_the_job_plainly_and_a_resume_continues_from_the_checkpoint(tmp_path, two_nodes):
    """The rollout worker's node is removed mid-run (its raylet and every process on it die): the job fails
    naming the node; once a node with the `rollout` resource is back, the job resumes after its checkpoint the
    way `miles jobs resume` does it (the store's resume, a new attempt, the driver on the same cluster)."""
    cluster, worker = two_nodes
    url = f"sqlite:///{tmp_path}/miles.db"
    args = [
        sys.executable, "-m", "miles_control.cli.main", "run", str(ROOT / "examples" / "arithmetic.yaml"), "--quiet",
        *[f"--set={o}" for o in (
            f"store.url={url}", f"output_dir={tmp_path}/runs", f"ray.address={cluster.address}",
            "resources.trainer_node={trainer: 1}", "resources.rollout_node={rollout: 1}", "rollout.engine.type=hf",
            "sync.transport=disk", "schedule.num_steps=30", "schedule.checkpoint_every=2",
            "rollout.num_prompts_per_step=8", "rollout.eval.num_prompts=20", "rollout.eval.every_steps=0",
        )],
    ]  # fmt: skip
    run = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    store = None
    deadline = time.time() + 600
    while time.time() < deadline and run.poll() is None:
        if (tmp_path / "miles.db").exists():
            store = Store(url)
            if store.last_checkpoint(1) is not None and len(store.steps(1)) >= 3:
                break
        time.sleep(0.2)  # 30 steps: the node goes while most of them are still to run, however fast the machine
    assert store is not None and run.poll() is None, run.communicate()[1][-3000:] if run.poll() is not None else ""
    cluster.remove_node(worker)
    _, stderr = run.communicate(timeout=300)
    assert run.returncode != 0
    job = store.job(1)
    assert job.status == "failed"
    assert "rollout worker" in job.error and worker.node_id[:8] in job.error, job.error

    cluster.add_node(num_cpus=1, resources={"rollout": 1})
    cluster.wait_for_nodes()
    resumed_after = store.resume(1)
    assert resumed_after >= 2
    store.set_status(1, JobStatus.STARTING, expect=JobStatus.QUEUED)  # what the launcher does, then:
    attempt = store.start_attempt(1, "test")
    driver = subprocess.run(
        [sys.executable, "-m", "miles_control.service.driver", "--job-id", "1", "--attempt-id", str(attempt.id),
         "--store", url, "--ray-address", cluster.address],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert driver.returncode == 0, driver.stderr[-3000:]
    assert store.job(1).status == "succeeded"
    assert [s.step for s in store.steps(1)] == list(range(1, 31))
    assert attempt.resume_step == resumed_after  # the new attempt started after the checkpoint, not from scratch
