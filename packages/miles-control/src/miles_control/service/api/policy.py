"""What a job spec submitted over the API may ask for, beyond what the spec itself validates.

A request body never brings code: rewards, generate functions and environments are built-in names or
functions of configured, installed modules. Paths are confined: prompt files under the data root, model folders under the model root, run
output under the server's runs folder. The store and the Ray cluster belong to the server."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from miles_control.service.launch.launcher import job_demand
from miles_control.service.settings import JobLimits, ServerSettings
from miles_control.spec.config import JobSpec
from miles_control.spec.paths import is_hub_dataset, path_values

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


LIMITED: dict[str, tuple[tuple[str, ...], ...]] = {  # JobLimits field → the spec fields it bounds
    "world_size": (
        ("train", "backend", "world_size"),
        ("train", "backend", "tensor_parallel_size"),
        ("train", "backend", "expert_parallel_size"),
    ),
    "num_engines": (("rollout", "engine", "num_engines"),),
    "num_steps": (("schedule", "num_steps"),),
    "max_minutes": (("schedule", "max_minutes"),),
    "num_prompts_per_step": (("rollout", "num_prompts_per_step"),),
    "num_samples_per_prompt": (("rollout", "num_samples_per_prompt"),),
    "max_new_tokens": (("rollout", "sampling", "max_new_tokens"),),
    "max_total_tokens": (("rollout", "engine", "max_total_tokens"), ("rollout", "multi_turn", "max_total_tokens")),
    "hidden_size": (("model", "hidden_size"),),
    "num_layers": (("model", "num_layers"),),
    "num_heads": (("model", "num_heads"), ("model", "num_kv_heads")),
    "intermediate_size": (("model", "intermediate_size"),),
    "warm_start_steps": (("model", "warm_start_steps"),),
    "batch_size": (
        ("model", "warm_start_batch_size"),
        ("rollout", "engine", "max_batch_size"),
        ("rollout", "engine", "max_requests_per_call"),
        ("rollout", "remote_reward", "batch_size"),
    ),
    "num_train": (("data", "num_train"),),
    "num_eval": (("data", "num_eval"), ("rollout", "eval", "num_prompts")),
    "num_threads": (
        ("rollout", "engine", "num_threads"),
        ("train", "backend", "num_threads"),
        ("ray", "num_cpus"),
        ("rollout", "remote_reward", "max_concurrent_requests"),
    ),
    "timeout_s": (
        ("rollout", "engine", "startup_timeout_s"),
        ("rollout", "engine", "request_timeout_s"),
        ("rollout", "engine", "health_interval_s"),
        ("rollout", "engine", "health_timeout_s"),
        ("rollout", "multi_turn", "step_timeout_s"),
        ("rollout", "remote_reward", "timeout_s"),
        ("rollout", "remote_reward", "backoff_s"),
        ("sync", "ready_timeout_s"),
        ("sync", "timeout_s"),
    ),
    "restarts": (
        ("rollout", "engine", "max_restarts"),
        ("schedule", "max_restarts"),
        ("rollout", "remote_reward", "max_retries"),
    ),
    "max_turns": (("rollout", "multi_turn", "max_turns"),),
    "bucket_bytes": (("sync", "bucket_bytes"),),
    "group_size": (("sync", "quant_group_size"), ("train", "quant_group_size")),
    "keep": (("sync", "keep_versions"), ("schedule", "keep_checkpoints")),
    "max_buckets_in_flight": (("sync", "max_buckets_in_flight"),),
    "num_minibatches": (("train", "algorithm", "num_minibatches"),),
    "lora_rank": (("train", "lora", "rank"),),
    "buffer": (("schedule", "buffer_groups"), ("schedule", "max_staleness")),
    "min_trainer_cpus_per_rank": (("ray", "trainer_cpus_per_rank"),),
    "min_rollout_cpus": (("ray", "rollout_cpus"),),
}

# Numbers of a spec that size nothing (rates, coefficients, seeds, ports, intervals whose growth does less work),
# by field name; a test walks the spec's models and fails on a number neither bounded nor listed here.
UNSIZED = frozenset(
    {
        "seed", "lr", "eps", "weight_decay", "max_grad_norm", "entropy_coef", "dual_clip", "clip_eps",
        "clip_eps_high", "kl_coef", "tis_cap", "staleness_decay", "drop_older_than", "value_clip", "gamma", "lam",
        "alpha", "dropout", "temperature", "top_p", "every_steps", "buffer", "factor", "eval_fraction",
        "warm_start_lr", "warm_start_target", "warm_start_call_share", "stop_at_accuracy", "checkpoint_every",
        "update_weights_interval", "master_port", "trainer_gpus_per_rank", "rollout_gpus_per_engine", "betas",
        "mis_band", "trainer_node", "rollout_node",  # custom Ray resources: placement checks them against the cluster
        "choices",  # rollout.judge: each verdict's reward
    }
)  # fmt: skip


def _check_limits(data: dict[str, Any], limits: JobLimits) -> list[Problem]:
    """Every bounded field the spec has (for its model source, engine and backend types) within the limit."""
    problems = []
    for name, locs in LIMITED.items():
        bound = getattr(limits, name)
        env = f"MILES_LIMITS__{name.upper()}"
        for loc in locs:
            value: Any = data
            for key in loc:
                value = value.get(key) if isinstance(value, dict) else None
            if not isinstance(value, int | float):
                continue
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

    roots = {"data": settings.data_root, "model": settings.model_root, "runs": settings.runs_root}
    for loc, node, key, (root_name, what) in list(path_values(data)):  # every path field (miles_control.spec.paths)
        raw, root = node[key], roots[root_name]
        if loc == ("data", "path") and is_hub_dataset(data, raw) and not (root / raw).exists():
            continue  # a Hub id: the driver looks it up in the Hugging Face cache only, never as a local path
        try:
            (root / raw).resolve()
        except (OSError, RuntimeError) as exc:
            problems.append(_problem(loc, f"{what} {raw!r} cannot be resolved ({exc})"))
            continue
        path = confine(root, raw)
        if path is None:
            problems.append(_problem(loc, f"{what} {raw!r} is outside {root.resolve()}"))
        else:
            node[key] = str(path)
    if "output_dir" not in spec.model_fields_set:
        data["output_dir"] = str(settings.runs_root)
    for index, tracker in enumerate(data["tracking"]):  # local files under the runs folder; no host to contact
        if tracker.get("tracking_uri") is not None:
            problems.append(_problem(("tracking", str(index), "tracking_uri"), "a tracking URI is not accepted over "
                                     "the API (a host to contact); the server's MLFLOW_TRACKING_URI applies"))  # fmt: skip
    if "dir" in spec.sync.model_fields_set:  # the disk transport deletes old versions there: each run has its own
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
    from miles_control.job.placement import check_gpus, make_plan

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
    from miles_rollout.plugin_check import locate_function

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
    env = rollout.environment
    if isinstance(env, str):  # called with environment_args as keywords: its arguments are not counted
        problems += _check_plugin("environment", env, [], settings, positional=None, classes=True)
    elif env is not None and env.type == "verifiers":  # its module's load_environment, job code like any plugin's
        module = env.id.replace("-", "_").split("/")[-1]
        problems += _check_plugin("rollout.environment.id", f"{module}:load_environment", [], settings, None)
    elif env is not None and env.app is not None:  # an OpenEnv app: a module the job's server would run
        module = env.app.partition(":")[0]
        if not any(module == m or module.startswith(m + ".") for m in settings.plugin_modules):
            allowed = ", ".join(settings.plugin_modules) or "none"
            problems.append(
                _problem(
                    ("rollout", "environment", "app"),
                    f"{env.app!r} is not in a module this server allows "
                    f"({allowed}); or give the url of a running server",
                )  # fmt: skip
            )
    problems += _check_plugin(
        "train.algorithm.name", spec.train.algorithm.name, list(ALGORITHMS), settings, positional=None, classes=True
    )
    if spec.data.map is not None:  # run on every row by the driver: a function of an allowed module, as above
        problems += _check_plugin("data.map", spec.data.map, [], settings, positional=1)
    return problems
