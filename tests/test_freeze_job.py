"""train.freeze in a whole job: the frozen tensors are never sent once sync.delta has a base (the engines loaded
them from the same checkpoint), every push still passes the weight check; a pattern the checkpoint lacks is refused
before anything starts, naming train.freeze[i]."""

import subprocess
import sys
from pathlib import Path

import pytest

from miles_control.service.store import Store

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    url = f"sqlite:///{tmp_path}/miles.db"
    args = [sys.executable, "-m", "miles_control.cli.main", "run", str(ROOT / "examples" / "quick.yaml"), "--quiet",
            "--set", f"store.url={url}", "--set", f"output_dir={tmp_path}/runs", "--set", "schedule.num_steps=2",
            "--set", "schedule.checkpoint_every=0", "--set", "rollout.eval.every_steps=0"]  # fmt: skip
    for override in overrides:
        args += ["--set", override]
    return subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=tmp_path)


@pytest.mark.slow
def test_a_frozen_embedding_and_layer_are_not_pushed_and_every_push_checks(tmp_path):
    result = _run(tmp_path, 'train.freeze=["model.embed_tokens.*", "model.layers.0.*"]', "sync.delta=true")
    assert result.returncode == 0, result.stderr[-4000:]
    store = Store(f"sqlite:///{tmp_path}/miles.db")
    assert store.job(1).status == "succeeded", store.job(1).error
    series = {name: dict(store.metric_series(1, name)) for name in
              ("sync/bytes", "sync/tensors", "sync/unchanged_tensors", "sync/weights_match")}  # fmt: skip
    assert series["sync/weights_match"] == {1: 1.0, 2: 1.0}  # the engine holds the trainer's weights, frozen included
    assert series["sync/unchanged_tensors"][1] == 0  # the first push is whole: no base yet
    from miles_control.job.assets import resolve_model_path
    from miles_control.spec.config import JobSpec
    from miles_train.freeze import check_patterns, parameter_names

    frozen = check_patterns(
        parameter_names(resolve_model_path(JobSpec.model_validate({"name": "x"}))),
        ["model.embed_tokens.*", "model.layers.0.*"],
    )
    # from the second push on, the frozen tensors are held back (unchanged), and the trained ones all moved
    assert series["sync/unchanged_tensors"][2] == len(frozen)
    assert series["sync/tensors"][2] == series["sync/tensors"][1] - len(frozen)
    assert series["sync/bytes"][2] < series["sync/bytes"][1]


def test_a_pattern_the_checkpoint_lacks_is_refused_before_start(tmp_path):
    result = _run(tmp_path, 'train.freeze=["model.layers.0.*", "visual.*"]')
    assert result.returncode != 0
    said = " ".join(result.stderr.split())  # the console wraps long lines
    assert "train.freeze[1]: 'visual.*' matches no parameter of model" in said, result.stderr[-3000:]
    assert "starting Ray" not in result.stdout + result.stderr  # refused before any actor or engine
