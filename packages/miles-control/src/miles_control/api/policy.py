"""What a job spec submitted over the API may ask for, beyond what the spec itself validates.

A request body never brings code: rewards, generate functions and environments are built-in names or
functions of configured, installed modules. Paths are confined: prompt files under the data root, model folders under the model root, run
output under the server's runs folder. The store and the Ray cluster belong to the server."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from miles_control.config import JobSpec
from miles_control.launch.launcher import job_demand
from miles_control.settings import JobLimits, ServerSettings

Problem = dict[str, Any]
log = logging.getLogger(__name__)


def _problem(loc: tuple[str, ...], msg: str) -> Problem:
    return {"loc": ["body", "spec", *loc], "msg": msg, "type": "value_error"}


def confine(root: Path, raw: str) -> Path | None:
    """`raw` resolved under `root` (relative paths are taken from the root), or None if it escapes it."""
    root = root.resolve()
    try:
        path = (root / raw).resolve()  # an absolute `raw` replaces root; `..` and symlinks are resolved
    except (OSError, RuntimeError):  # a symlink loop, a name too long: not a path a job can use
        return None
    return path if path == root or root in path.parents else None


LIMITED: dict[str, tuple[str, ...]] = {  # JobLimits field → the spec field it bounds
    "world_size": ("train", "backend", "world_size"),
    "num_engines": ("rollout", "engine", "num_engines"),
    "num_steps": ("schedule", "num_steps"),
    "max_minutes": ("schedule", "max_minutes"),
    "num_prompts_per_step": ("rollout", "num_prompts_per_step"),
    "num_samples_per_prompt": ("rollout", "num_samples_per_prompt"),
    "max_new_tokens": ("rollout", "sampling", "max_new_tokens"),
    "max_total_tokens": ("rollout", "engine", "max_total_tokens"),
    "hidden_size": ("model", "hidden_size"),
    "num_layers": ("model", "num_layers"),
    "intermediate_size": ("model", "intermediate_size"),
    "warm_start_steps": ("model", "warm_start_steps"),
    "min_trainer_cpus_per_rank": ("ray", "trainer_cpus_per_rank"),
    "min_rollout_cpus": ("ray", "rollout_cpus"),
}


def _check_limits(data: dict[str, Any], limits: JobLimits) -> list[Problem]:
    """Every bounded field the spec has (for its model source, engine and backend types) within the limit."""
    problems = []
    for name, loc in LIMITED.items():
        value: Any = data
        for key in loc:
            value = value.get(key) if isinstance(value, dict) else None
        if value is None:
            continue
        bound = getattr(limits, name)
        env = f"MILES_LIMITS__{name.upper()}"
        if name.startswith("min_") and value < bound:
            problems.append(_problem(loc, f"{value:g} is below this server's minimum of {bound:g} ({env})"))
        elif not name.startswith("min_") and value > bound:
            problems.append(_problem(loc, f"{value:g} is above this server's limit of {bound:g} ({env})"))
    return problems


def check_spec(spec: JobSpec, settings: ServerSettings) -> tuple[JobSpec, list[Problem]]:
    """Returns the spec with its paths made absolute (and the server's store and runs folder), or problems."""
    problems: list[Problem] = []
    data = spec.model_dump(mode="json")
    if "store" in spec.model_fields_set:
        problems.append(_problem(("store",), "the server's store records API jobs; leave `store` out"))
    if "address" in spec.ray.model_fields_set and spec.ray.address is not None:
        problems.append(_problem(("ray", "address"), "the server decides where jobs run; leave `ray.address` out"))

    def confined(root: Path, raw: str | None, loc: tuple[str, ...], what: str) -> str | None:
        if raw is None:
            return None
        try:
            (root / raw).resolve()
        except (OSError, RuntimeError) as exc:
            problems.append(_problem(loc, f"{what} {raw!r} cannot be resolved ({exc})"))
            return raw
        path = confine(root, raw)
        if path is None:
            problems.append(_problem(loc, f"{what} {raw!r} is outside {root.resolve()}"))
            return raw
        return str(path)

    if data["model"]["source"] == "path":
        data["model"]["path"] = confined(settings.model_root, data["model"]["path"], ("model", "path"), "model folder")
    if data["train"].get("teacher") is not None:  # distill's teacher: a model folder like model.path
        data["train"]["teacher"] = confined(
            settings.model_root, data["train"]["teacher"], ("train", "teacher"), "teacher folder"
        )
    critic = data["train"].get("critic") or {}
    if critic.get("model") is not None:  # ppo's value model: a model folder like model.path
        critic["model"] = confined(settings.model_root, critic["model"], ("train", "critic", "model"), "critic folder")
    hub_dataset = data["data"]["source"] == "hf" and _hub_id_not_local(settings.data_root, data["data"]["path"])
    for key in ("path", "eval_path"):
        if not (key == "path" and hub_dataset):  # a Hub dataset id goes to the server's Hugging Face cache
            data["data"][key] = confined(settings.data_root, data["data"][key], ("data", key), "prompt file")
    if data["data"]["chat_template"] not in ("none", "model"):  # a Jinja file, read by the driver
        data["data"]["chat_template"] = confined(
            settings.data_root, data["data"]["chat_template"], ("data", "chat_template"), "chat template"
        )
    runs = settings.runs_root
    data["output_dir"] = (
        confined(runs, data["output_dir"], ("output_dir",), "output folder")
        if "output_dir" in spec.model_fields_set
        else str(runs)
    )
    for index, tracker in enumerate(data["tracking"]):  # local files under the runs folder; no host to contact
        if tracker.get("dir") is not None:
            tracker["dir"] = confined(runs, tracker["dir"], ("tracking", str(index), "dir"), "tracking folder")
        if tracker.get("tracking_uri") is not None:
            problems.append(_problem(("tracking", str(index), "tracking_uri"), "a tracking URI is not accepted over "
                                     "the API (a host to contact); the server's MLFLOW_TRACKING_URI applies"))  # fmt: skip
    if data["sync"].get("dir") is not None:  # the disk transport deletes old versions there: each run has its own
        problems.append(_problem(("sync", "dir"), "the server gives each run its own weights folder; leave it out"))
    for key in ("master_address", "master_port"):  # as engine `urls`: a job over the API names no host to contact
        if key in spec.sync.model_fields_set:
            problems.append(_problem(("sync", key), "the server chooses the weight group's rendezvous; leave it out"))
    engine = data["rollout"]["engine"]  # by the fields an engine kind has, whichever kind it is
    if engine.get("extra_args"):
        problems.append(
            _problem(("rollout", "engine", "extra_args"), "extra SGLang flags are not accepted over the API")
        )
    if engine.get("urls"):
        problems.append(
            _problem(("rollout", "engine", "urls"), "attaching to servers by URL is not accepted over the API")
        )
    if engine.get("log_dir") is not None:
        engine["log_dir"] = confined(runs, engine["log_dir"], ("rollout", "engine", "log_dir"), "log folder")
    problems.extend(_check_limits(data, settings.limits))
    problems.extend(_check_plugins(spec, settings))
    if spec.rollout.remote_reward is not None:
        problems.append(
            _problem(
                ("rollout", "remote_reward"), "a reward service URL is not accepted over the API (a host to contact)"
            )
        )
    demand = job_demand(spec)
    if demand > settings.cpus:
        problems.append(
            _problem(("ray",), f"the job reserves {demand:g} CPUs; this server runs jobs on {settings.cpus:g}")
        )
    problems.extend(_check_gpus(spec, settings))
    data.pop("store", None)
    return JobSpec.model_validate(data), problems


def local_gpus() -> int:
    """The GPUs a Ray node started on this machine would detect: CUDA_VISIBLE_DEVICES when set, else the NVIDIA
    driver's list of devices (none on a machine without the driver)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # CUDA stops at the first entry that names no device ("-1", "NoDevFiles", "")
        count = 0
        for entry in (d.strip() for d in visible.split(",")):
            if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
                break
            count += 1
        return count
    devices = Path("/proc/driver/nvidia/gpus")
    return len(list(devices.iterdir())) if devices.is_dir() else 0


def cluster_gpus(settings: ServerSettings) -> tuple[float, str] | None:
    """(GPUs jobs of this server may use, where they are), or None when they cannot be known now."""
    if settings.gpus is not None:
        return settings.gpus, "this server (MILES_GPUS)"
    if settings.launcher == "ray_job" and settings.ray_address:
        try:
            from ray.util.state import list_nodes

            nodes = list_nodes(address=settings.ray_address, filters=[("state", "=", "ALIVE")], limit=10_000, timeout=3)
        except Exception as exc:  # the launcher reports an unreachable cluster; the job checks at its start
            log.warning("GPUs of %s not known at submission: %s", settings.ray_address, exc)
            return None
        return sum(n.resources_total.get("GPU", 0) for n in nodes), f"the Ray cluster at {settings.ray_address}"
    if settings.launcher == "local" and not settings.ray_address:
        return float(local_gpus()), "this machine"
    return None


def _check_gpus(spec: JobSpec, settings: ServerSettings) -> list[Problem]:
    """The job's resource plan against the GPUs it would run on (CPUs are the queue's; custom resources and
    labels are checked when the job starts, against the cluster it then finds)."""
    from miles_control.placement import check_gpus, make_plan

    known = cluster_gpus(settings)
    if known is None:
        return []
    gpus, where = known
    try:
        check_gpus(make_plan(spec, {"GPU": gpus, "CPU": settings.cpus}, fit=False), gpus, where)
    except ValueError as exc:  # PlanError, or a server flag the plan cannot read (the spec checks them too)
        return [_problem(("resources",), str(exc))]
    return []


def _check_plugin(
    field: str,
    path: str,
    builtin: list[str],
    settings: ServerSettings,
    positional: int | None,
    classes: bool = False,
    coroutine: bool = False,
) -> list[Problem]:
    """`rollout.<field>` (or the dotted location `field` names, e.g. `train.algorithm.name`): a built-in name, or a
    top-level function (or class, where `classes`) of a module the server's settings allow (`plugin_modules`), read
    without importing it."""
    location = tuple(field.split(".")) if "." in field else ("rollout", field)
    what = location[-2] if location[-1] == "name" else location[-1]
    if path in builtin:
        return []
    module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")

    def allowed(name: str) -> bool:
        return any(name == m or name.startswith(m + ".") for m in settings.plugin_modules)

    if not allowed(module) or not attr.isidentifier():  # a function of the module itself, not a path through it
        names = ", ".join(builtin) or "none"
        extra = f"; or a function of {', '.join(settings.plugin_modules)}" if settings.plugin_modules else ""
        return [_problem(location, f"unknown {what} {path!r}: use one of {names}{extra}")]
    from miles_rollout.plugins import locate_function

    try:  # read, not imported: a module runs when imported, and the server must not run job code
        locate_function(path, positional=positional, classes=classes, coroutine=coroutine)
    except (ValueError, OSError, SyntaxError) as exc:
        return [_problem(location, str(exc))]
    return []


def _check_plugins(spec: JobSpec, settings: ServerSettings) -> list[Problem]:
    """The reward, the generate function, the environment factory and the trainer's objective."""
    from miles_rollout.generate import BUILTIN
    from miles_rollout.rewards import registered_rewards
    from miles_train.config import ALGORITHMS

    rollout = spec.rollout
    problems = _check_plugin("reward", rollout.reward, registered_rewards(), settings, positional=1)
    problems += _check_plugin("generate", rollout.generate, sorted(BUILTIN), settings, positional=4, coroutine=True)
    if rollout.environment is not None:  # called with environment_args as keywords: its arguments are not counted
        problems += _check_plugin("environment", rollout.environment, [], settings, positional=None, classes=True)
    problems += _check_plugin(
        "train.algorithm.name", spec.train.algorithm.name, list(ALGORITHMS), settings, positional=None, classes=True
    )
    if spec.data.map is not None:  # run on every row by the driver: a function of an allowed module, as above
        problems += _check_plugin("data.map", spec.data.map, [], settings, positional=1)
    return problems


def _hub_id_not_local(root: Path, raw: str | None) -> bool:
    """`data.path` of `source: hf` names a Hub dataset: a valid id, and nothing of that name under the data root."""
    from miles_control.config import check_repo_id

    if raw is None or raw.startswith(("/", ".", "~")):
        return False
    try:
        check_repo_id(raw)
    except ValueError:
        return False
    return not (root / raw).exists()
