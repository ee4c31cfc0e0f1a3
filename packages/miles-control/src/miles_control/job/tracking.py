"""Experiment trackers as sinks beside the store: Weights & Biases, TensorBoard, MLflow.

The driver's recorder hands every metric the store gets to each tracker of `spec.tracking`, with its step, and
every span as its duration (`time/<stage>_s`: rollout, reward, train, weight_sync, eval, ...). Each tracker goes
through its own library (`pip install "miles-control[tracking]"`); the store stays the record of the job, so a
tracker that cannot start or fails later (no key, no network, a full disk) warns once, as a log line and an event of
the job, and the run goes on without it. A resumed attempt logs the steps it redoes again (a tracker cannot take
points back as the store does).
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from miles_control.spec.config import JobSpec, MLflowTracker, TensorBoardTracker, TrackerConfig, WandbTracker

log = logging.getLogger(__name__)

STEP_KEY = "step"  # W&B: the x-axis of every metric (points of earlier steps arrive late under async schedules)


class Tracker:
    """One tracker's run. `link` is where a person finds it (a URL, or a local folder or store URI)."""

    kind = ""
    link = ""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class WandbRun(Tracker):
    kind = "wandb"

    def __init__(self, config: WandbTracker, spec: dict[str, Any], name: str, folder: Path) -> None:
        import wandb

        if config.mode == "online" and not (os.environ.get("WANDB_API_KEY") or _wandb_netrc_key()):
            raise RuntimeError(
                "no W&B API key: set WANDB_API_KEY (or run `wandb login`), or use tracking mode: offline"
            )
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=config.project,
            entity=config.entity,
            name=name,
            tags=config.tags or None,
            config=spec,
            dir=str(folder),
            mode=config.mode,
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off", init_timeout=60),
        )
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        self.link = getattr(self.run, "url", None) or str(Path(self.run.dir).parent)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({STEP_KEY: step, **metrics})

    def close(self) -> None:
        self.run.finish()


class TensorBoardRun(Tracker):
    kind = "tensorboard"

    def __init__(self, config: TensorBoardTracker, spec: dict[str, Any], name: str, folder: Path) -> None:
        import json

        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder / config.project / name
        self.writer = SummaryWriter(log_dir=str(self.folder))
        self.writer.add_text("spec", "```\n" + json.dumps(spec, indent=1) + "\n```", 0)
        self.link = str(self.folder)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MLflowRun(Tracker):
    kind = "mlflow"

    def __init__(self, config: MLflowTracker, spec: dict[str, Any], name: str, folder: Path) -> None:
        from mlflow.tracking import MlflowClient

        folder.mkdir(parents=True, exist_ok=True)
        uri = config.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{folder / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(config.project)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(config.project, artifact_location=(folder / "artifacts").as_uri())
        )
        run = self.client.create_run(experiment_id, run_name=name, tags={tag: "" for tag in config.tags})
        self.run_id = run.info.run_id
        self.client.log_dict(self.run_id, spec, "spec.json")
        self.link = f"{uri} (experiment {config.project}, run {self.run_id})"

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


KINDS: dict[str, type[Tracker]] = {"wandb": WandbRun, "tensorboard": TensorBoardRun, "mlflow": MLflowRun}
LIBRARIES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}


def _wandb_netrc_key() -> bool:
    import netrc

    try:
        return bool(netrc.netrc().authenticators("api.wandb.ai"))
    except (OSError, netrc.NetrcParseError):
        return False


class Trackers:
    """The trackers of one job: each started once, given every metric, and dropped after its first failure
    (`warn(message)` says so once; the job goes on)."""

    def __init__(self, spec: JobSpec, job_id: int, warn) -> None:
        self.warn = warn
        self.active: list[Tracker] = []
        name_default = f"{spec.name}-job{job_id}"
        dumped = spec.model_dump(mode="json")
        for index, config in enumerate(spec.tracking):
            name = config.run_name or name_default
            folder = Path(config.dir or Path(spec.output_dir) / "tracking" / config.type).resolve()
            try:
                tracker = KINDS[config.type](config, dumped, name, folder)  # type: ignore[arg-type]
            except ImportError as exc:
                self._failed(index, config, f"its library is not installed ({exc.name}): pip install "
                             f'"miles-control[tracking]" (or {LIBRARIES[config.type]})')  # fmt: skip
                continue
            except Exception as exc:  # a tracker never stops the job
                self._failed(index, config, f"{type(exc).__name__}: {exc}")
                continue
            self.active.append(tracker)

    def _failed(self, index: int, config: TrackerConfig, why: str) -> None:
        self.warn(f"tracking[{index}] ({config.type}) cannot start; the run goes on without it: {why}", config.type)

    def links(self) -> list[tuple[str, str]]:
        return [(t.kind, t.link) for t in self.active]

    def log(self, step: int, metrics: dict[str, float]) -> None:
        finite = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}
        if not finite:
            return
        for tracker in list(self.active):
            try:
                tracker.log(step, finite)
            except Exception as exc:
                self.active.remove(tracker)
                self.warn(f"tracking ({tracker.kind}) failed; the run goes on without it: {type(exc).__name__}: "
                          f"{exc}", tracker.kind)  # fmt: skip

    def close(self) -> None:
        for tracker in self.active:
            try:
                tracker.close()
            except Exception as exc:
                log.warning("tracking (%s): closing failed: %s", tracker.kind, exc)
        self.active = []
