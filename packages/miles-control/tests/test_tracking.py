"""Issue 39, item 3: experiment trackers beside the store, each read back through its own library (W&B offline:
its transaction log; TensorBoard: its event reader; MLflow: its client), and a tracker that fails warns once."""

import glob
import json
import struct
import sys
from pathlib import Path

import pytest

from miles_control.job.tracking import Trackers
from miles_control.spec.load import SpecError, parse_spec

POINTS = [(0, {"eval/accuracy": 0.25}), (1, {"train/loss": 0.5, "reward/mean": 0.1}), (2, {"train/loss": 0.4})]
LATE = (1, {"eval/accuracy": 0.5})  # an async eval of step 1 that arrives after step 2


def wandb_history(folder: Path) -> tuple[list[dict], dict]:
    """The rows and the run record of an offline W&B run, from its transaction log (`run-*.wandb`: the LevelDB log
    format, 32 KiB blocks of chunks with a 7-byte header, after a 7-byte file header), decoded with W&B's own
    protobuf messages. wandb 0.31 ships no reader of its own."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(folder / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, pos, chunk, records = Path(path).read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and length == 0:  # padding to the block's end
            pos += left - 7
            continue
        chunk += data[pos : pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST
            records.append(chunk)
            chunk = b""
    rows, run = [], {}
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
        elif record.WhichOneof("record_type") == "run":
            config = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.run.config.update}
            run = {"name": record.run.display_name, "project": record.run.project, "tags": list(record.run.tags),
                   "config": config}  # fmt: skip
    return rows, run


def spec_with(tmp_path, tracking) -> object:
    return parse_spec({"name": "tracked", "output_dir": str(tmp_path / "runs"), "tracking": tracking})


def test_every_point_reaches_each_tracker_with_its_step(tmp_path):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec = spec_with(tmp_path, [{"type": "wandb", "mode": "offline", "tags": ["t1"]}, "tensorboard",
                                {"type": "mlflow", "project": "exp", "run_name": "named"}])  # fmt: skip
    warnings = []
    trackers = Trackers(spec, 7, lambda message, kind: warnings.append(message))
    assert [kind for kind, _ in trackers.links()] == ["wandb", "tensorboard", "mlflow"], warnings
    for step, metrics in [*POINTS, LATE]:
        trackers.log(step, metrics)
    trackers.log(3, {"nan": float("nan")})  # not finite: left out (no tracker stores it faithfully)
    trackers.close()
    assert warnings == []
    expected = {(name, step, value) for step, metrics in [*POINTS, LATE] for name, value in metrics.items()}

    rows, run = wandb_history(tmp_path / "runs" / "tracking" / "wandb")
    assert {(k, row["step"], v) for row in rows for k, v in row.items() if k != "step"} == expected
    assert run["name"] == "tracked-job7" and run["project"] == "miles" and run["tags"] == ["t1"]
    assert run["config"]["name"] == "tracked" and run["config"]["tracking"][0]["type"] == "wandb"  # the spec

    board = EventAccumulator(str(tmp_path / "runs" / "tracking" / "tensorboard" / "miles" / "tracked-job7"))
    board.Reload()
    seen = {(tag, e.step, round(e.value, 6)) for tag in board.Tags()["scalars"] for e in board.Scalars(tag)}
    assert seen == {(name, step, round(value, 6)) for name, step, value in expected}  # TensorBoard keeps float32
    assert "spec" in "".join(board.Tags()["tensors"])  # the spec as text

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'tracking' / 'mlflow' / 'mlflow.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert found.info.run_name == "named" and found.info.status == "FINISHED"
    names = {name for name, _, _ in expected}
    got = {(m.key, m.step, m.value) for name in names for m in client.get_metric_history(found.info.run_id, name)}
    assert got == expected


def test_a_tracker_that_cannot_start_or_fails_later_warns_once_and_the_others_go_on(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setitem(sys.modules, "mlflow", None)  # the library missing: `import mlflow` raises ImportError
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    spec = spec_with(tmp_path, ["wandb", "mlflow", "tensorboard"])
    warnings = []
    trackers = Trackers(spec, 1, lambda message, kind: warnings.append((kind, message)))
    assert [kind for kind, _ in trackers.links()] == ["tensorboard"]
    assert warnings[0][0] == "wandb" and "tracking[0] (wandb) cannot start" in warnings[0][1]
    assert "set WANDB_API_KEY" in warnings[0][1] and "mode: offline" in warnings[0][1]
    assert warnings[1][0] == "mlflow" and 'pip install "miles-control[tracking]"' in warnings[1][1]

    board = trackers.active[0]

    def broken(step, metrics):
        raise OSError("No space left on device")

    monkeypatch.setattr(board, "log", broken)
    trackers.log(1, {"a": 1.0})
    trackers.log(2, {"a": 2.0})
    trackers.close()
    assert len(warnings) == 3 and "tracking (tensorboard) failed; the run goes on without it: OSError" in warnings[2][1]


def test_tracking_in_the_spec():
    spec = parse_spec({"name": "t", "tracking": ["wandb", {"type": "mlflow", "tracking_uri": "http://mlflow:5000"}]})
    assert [t.type for t in spec.tracking] == ["wandb", "mlflow"] and spec.tracking[0].mode == "online"
    with pytest.raises(SpecError, match="wandb given more than once"):
        parse_spec({"name": "t", "tracking": ["wandb", {"type": "wandb"}]})
    with pytest.raises(SpecError, match="tracking.0"):
        parse_spec({"name": "t", "tracking": ["comet"]})
