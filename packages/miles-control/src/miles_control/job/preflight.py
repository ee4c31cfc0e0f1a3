"""What a job is checked for before any actor starts, so that a bad combination fails in seconds with the
field to change rather than minutes later inside a Ray actor:

- the model is one the chosen trainer backend and rollout engine run (a refused config.json field is named);
- pushes can reach the engines exactly (`sync.dtype` against the dtype the engines hold);
- fp16 training is not asked of a checkpoint that declares bfloat16 (unless `train.allow_fp16`);
- the low-precision formats (`sync.quantization`, `train.quantization`) fit the model's linear layers;
- the reward, the generate function and the environment resolve; an episode fits the model's context;
- the chat template renders every prompt.

Plug-in modules (rewards named by dotted path) are found on the module search path, extended by
MILES_PLUGIN_DIRS (`miles_rollout.plugin_check`): `miles run` sets it to the job file's folder here, and the
runtime hands it to Ray's workers.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Sequence
from pathlib import Path

from miles_control.job.vision_check import check_vision
from miles_control.spec.config import JobSpec


class JobCheckError(ValueError):
    """A job that cannot run as specified; the message names the field (or config.json field) to change."""


def add_plugin_dirs(dirs: Sequence[str | Path]) -> str:
    """Make modules in `dirs` importable by dotted path in this process and the processes it starts (after the
    installed packages); returns the value of MILES_PLUGIN_DIRS to give workers."""
    from miles_rollout.plugin_check import PLUGIN_DIRS_ENV, plugin_dirs_on_path

    known = [d for d in os.environ.get(PLUGIN_DIRS_ENV, "").split(os.pathsep) if d]
    for folder in (str(Path(d).resolve()) for d in dirs):
        if folder not in known:
            known.append(folder)
    os.environ[PLUGIN_DIRS_ENV] = os.pathsep.join(known)
    plugin_dirs_on_path()
    return os.environ[PLUGIN_DIRS_ENV]


EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")  # config.json: a mixture of experts


def check_job(spec: JobSpec, model_path: Path, prompts: Sequence = ()) -> None:
    """Raise JobCheckError for the first problem found (see the module docstring)."""
    from transformers import AutoConfig

    from miles_rollout.engines import check_model as check_engine_model
    from miles_rollout.engines.checkpoint import engine_dtype
    from miles_rollout.rewards import probe_reward, registered_rewards, resolve_reward
    from miles_train.backends import check_model as check_backend_model

    hf_config = AutoConfig.from_pretrained(str(model_path))
    try:
        check_backend_model(spec.train.backend, hf_config)
        check_engine_model(spec.rollout.engine, hf_config)
    except ValueError as exc:
        raise JobCheckError(f"model {model_path}: {exc}") from None
    try:
        spec.sync.for_engines(engine_dtype(spec.rollout.engine.dtype, model_path))
    except ValueError as exc:
        raise JobCheckError(str(exc)) from None
    experts = next((f"{k}: {v}" for k in EXPERT_FIELDS if (v := getattr(hf_config, k, None))), None)
    routed = getattr(spec.rollout.engine, "routed_experts", False)
    if routed and not experts:
        field = "train.routing_replay" if spec.train.routing_replay else "rollout.engine.routed_experts"
        raise JobCheckError(
            f"{field}: model {model_path} is not a mixture of experts (its config.json has none of "
            f"{', '.join(EXPERT_FIELDS)}): there is no routing to return or replay"
        )
    if experts and spec.sync.transport == "p2p":
        raise JobCheckError(
            f"sync.transport: p2p sends each trainer rank's rows of the model's own tensors, and this model "
            f"({experts} in config.json) holds its experts fused, in another layout than the checkpoint a push "
            "carries; use disk, shm or broadcast"
        )
    check_precision(spec, model_path)
    check_quantization(spec, hf_config)
    if spec.train.freeze:  # each pattern against the trainer's parameter names (the model built on the meta device)
        from miles_train.freeze import check_patterns, parameter_names

        try:
            check_patterns(parameter_names(model_path), spec.train.freeze, f"model {model_path}")
        except ValueError as exc:
            raise JobCheckError(str(exc)) from None
    try:
        reward = resolve_reward(
            spec.rollout.reward, spec.rollout.remote_reward, spec.rollout.code_sandbox, spec.rollout.judge
        )
        if spec.rollout.reward not in registered_rewards() and prompts:  # a user's reward: tried on the data now
            # an episode's reward reads its transcript, which only a rollout makes: its signature is checked alone
            probe_reward(reward, spec.rollout.reward, prompts[0], call=spec.rollout.environment is None)
    except ValueError as exc:
        raise JobCheckError(f"rollout.reward: {exc}") from None
    if spec.rollout.reward == "code":  # the sandbox can run here (the tool, the interpreter), before any engine
        from miles_rollout.sandbox import SandboxError, check_sandbox

        try:
            check_sandbox(spec.rollout.code_sandbox.tool, spec.rollout.code_sandbox.python)
        except SandboxError as exc:
            raise JobCheckError(f"rollout.code_sandbox.{exc}") from None
    if spec.rollout.reward == "judge" and spec.rollout.judge is not None:
        check_judge(spec.rollout.judge)
    check_episodes(spec, hf_config)
    if spec.train.teacher is not None:
        check_teacher(spec, hf_config)
    if spec.train.critic is not None and spec.train.critic.model is not None:
        check_critic(Path(spec.train.critic.model), hf_config)
    from miles_train.objectives import build_objective

    try:  # a user objective imports and constructs here, in the driver, before any actor starts
        build_objective(spec.train.algorithm)
    except ValueError as exc:
        raise JobCheckError(f"train.algorithm: {exc}") from None
    check_vision(spec, hf_config, model_path, prompts)
    if spec.data.chat_template != "none" and prompts:
        from miles_rollout.prompts import load_encoder

        encoder = load_encoder(model_path, spec.data.chat_template, spec.data.system_prompt)
        for record in prompts:  # every prompt renders (a template may refuse some conversations): ~0.1 ms each
            encoder.text(record)
        first = next((r for r in prompts if r.images), None)
        if first is not None:  # the processor takes the images (a few ms): one prompt shows it can
            encoder.inputs(first)


def check_episodes(spec: JobSpec, hf_config) -> None:
    """The generate function and the environment factory import, one environment can be made with
    `rollout.environment_args`; an episode fits the model's context."""
    from miles_rollout.env import environment_factory
    from miles_rollout.generate import resolve_generate

    rollout = spec.rollout
    try:
        resolve_generate(rollout.generate)
    except ValueError as exc:
        raise JobCheckError(str(exc) if str(exc).startswith("rollout.") else f"rollout.generate: {exc}") from None
    if rollout.environment is not None and not isinstance(rollout.environment, str):
        check_hub_environment(rollout.environment)
    elif rollout.environment is not None:
        try:
            make = environment_factory(rollout.environment, rollout.environment_args)
        except ValueError as exc:
            raise JobCheckError(
                str(exc) if str(exc).startswith("rollout.") else f"rollout.environment: {exc}"
            ) from None
        try:  # one environment, made here as every episode makes its own: arguments it refuses fail now
            make()
        except Exception as exc:
            message = str(exc) if str(exc).startswith("rollout.") else f"{type(exc).__name__}: {exc}"
            raise JobCheckError(
                f"rollout.environment_args: {rollout.environment}({rollout.environment_args}) failed: {message}"
            ) from None
    context = getattr(hf_config.get_text_config(), "max_position_embeddings", None)
    if rollout.generate == "multi_turn" and context is not None and rollout.multi_turn.max_total_tokens > context:
        raise JobCheckError(
            f"rollout.multi_turn.max_total_tokens: {rollout.multi_turn.max_total_tokens} is more than the model's "
            f"context (config.json max_position_embeddings: {context})"
        )


def check_judge(judge) -> None:
    """The judge's model folder holds a model its engine serves (`model: policy` is the job's, checked above)."""
    from transformers import AutoConfig

    from miles_rollout.engines import check_model as check_engine_model
    from miles_rollout.judge import engine_config

    if judge.model == "policy":
        return
    folder = Path(judge.model)
    if not (folder / "config.json").is_file():
        raise JobCheckError(f"rollout.judge.model: {judge.model!r} is not a model folder (no config.json)")
    try:
        check_engine_model(engine_config(judge), AutoConfig.from_pretrained(str(folder)))
    except ValueError as exc:
        raise JobCheckError(f"rollout.judge.engine: {exc}") from None


def check_hub_environment(env) -> None:
    """A verifiers environment loads and Miles can drive it; an OpenEnv server starts (or the one at `url` answers)
    and one session resets: before any engine starts, naming the field."""
    if env.type == "verifiers":
        from miles_rollout.hubs.verifiers_env import load

        try:
            load(env)
        except ValueError as exc:
            raise JobCheckError(str(exc)) from None
        return
    from miles_rollout.hubs.openenv_env import Server, Session, session_factory

    try:
        session_factory(env)
    except ValueError as exc:
        raise JobCheckError(str(exc)) from None
    if env.app is not None and importlib.util.find_spec(env.app.partition(":")[0]) is None:
        raise JobCheckError(f"rollout.environment.app: no module {env.app.partition(':')[0]!r} (installed, or in the "
                            "job's plugin folders)")  # fmt: skip
    server = Server(env.app, env.start_timeout_s) if env.app is not None else None
    session = Session(env.model_copy(update={"retries": 0}))
    try:
        if server is not None:
            url = server.ensure()
            session.spec = session.spec.model_copy(update={"app": None, "url": url})
        session.reset(None)
    except Exception as exc:  # noqa: BLE001 - the server's or its environment's, reported with the field
        where = "app" if env.app is not None else "url"
        raise JobCheckError(f"rollout.environment.{where}: one OpenEnv session failed to reset: {type(exc).__name__}: "
                            f"{exc}"[:800]) from None  # fmt: skip
    finally:
        session.close()
        if server is not None:
            server.stop()


def check_teacher(spec: JobSpec, hf_config) -> None:
    """distill's teacher: an HF folder the backend can build, scoring the student's token ids (the same vocabulary)."""
    from transformers import AutoConfig

    from miles_train.backends import check_model as check_backend_model

    folder = Path(str(spec.train.teacher))
    if not (folder / "config.json").exists():
        raise JobCheckError(f"train.teacher: {folder} is not an HF model folder (no config.json)")
    teacher = AutoConfig.from_pretrained(str(folder))
    if teacher.vocab_size != hf_config.vocab_size:
        raise JobCheckError(
            f"train.teacher: its vocabulary has {teacher.vocab_size} ids, the student's {hf_config.vocab_size}: the "
            "teacher must score the student's token ids (the same tokenizer)"
        )
    try:
        check_backend_model(spec.train.backend, teacher)
    except ValueError as exc:
        raise JobCheckError(f"train.teacher {folder}: {exc}") from None


def check_critic(folder: Path, hf_config) -> None:
    """ppo's value model from its own folder: an HF model whose embedding covers the policy's token ids."""
    from transformers import AutoConfig

    if not (folder / "config.json").exists():
        raise JobCheckError(f"train.critic.model: {folder} is not an HF model folder (no config.json)")
    critic = AutoConfig.from_pretrained(str(folder))
    if getattr(critic, "vocab_size", 0) < hf_config.vocab_size:
        raise JobCheckError(
            f"train.critic.model: its vocabulary has {critic.vocab_size} ids, the policy's {hf_config.vocab_size}: "
            "the critic reads the policy's token ids (use a model with the same tokenizer)"
        )


def check_precision(spec: JobSpec, model_path: Path) -> None:
    """fp16 compute on a checkpoint that declares bfloat16 is refused unless `train.allow_fp16`: a model trained in
    bf16 has never been kept within fp16's range (largest value 65504), and its activations can pass it."""
    from miles_rollout.engines.checkpoint import checkpoint_dtype

    if spec.train.precision != "fp16" or spec.train.allow_fp16:
        return
    declared = checkpoint_dtype(model_path)
    if declared == "bfloat16":
        raise JobCheckError(
            f"train.precision: fp16 on {model_path}, whose config.json declares dtype bfloat16: a model trained in "
            "bf16 can carry activations past fp16's largest value (65504), which the loss scaler cannot fix; use "
            "train.precision bf16, or set train.allow_fp16: true to train it in fp16 anyway (overflowing steps are "
            "skipped and counted in train/overflow_skipped)"
        )


# A format's block along the input dimension (and, for fp8_block, along the output dimension too).
_BLOCKS = {"mxfp8": 32, "nvfp4": 16, "fp8_block": 128}


def check_quantization(spec: JobSpec, hf_config) -> None:
    """Every linear layer of the model is a whole number of the format's blocks (INT4: of its groups)."""
    if spec.sync.quantization == "none" and spec.train.quantization == "none":
        return
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    inputs = {
        "hidden_size": hf_config.hidden_size,
        "intermediate_size": hf_config.intermediate_size,
        "num_attention_heads × head_dim": hf_config.num_attention_heads * head_dim,
    }
    outputs = inputs | {"num_key_value_heads × head_dim": kv_heads * head_dim}
    backend = spec.train.backend
    tp = getattr(backend, "tensor_parallel_size", 1)
    if backend.type == "megatron" and tp > 1:
        # megatron quantizes its own shards: the row-parallel layers (attention output, MLP down) split their
        # input dimension over the tensor-parallel ranks, so each rank's part must be whole blocks too
        split = {
            "intermediate_size / tensor_parallel_size": hf_config.intermediate_size // tp,
            "num_attention_heads × head_dim / tensor_parallel_size": hf_config.num_attention_heads * head_dim // tp,
        }
    else:
        split = {}
    for section in ("sync", "train"):
        part = getattr(spec, section)
        fmt = part.quantization
        if fmt == "none":
            continue
        block = part.quant_group_size if fmt == "int4" else _BLOCKS.get(fmt)
        if block is None:
            continue  # fp8: one scale per tensor, any shape
        what = f"{section}.quant_group_size {block}" if fmt == "int4" else f"its {block}-element blocks"
        dims = outputs if fmt == "fp8_block" else inputs
        if section == "train":
            dims = dims | split
        for field, size in dims.items():
            if size % block:
                raise JobCheckError(
                    f"{section}.quantization: {fmt} needs every linear layer to be a whole number of blocks, but "
                    f"{what} do not divide the model's {field} ({size})"
                )


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def plain_error(exc: BaseException) -> BaseException:
    """The exception a user should see: for an error raised inside a Ray actor, the original one (Ray wraps it
    with the remote traceback and terminal colour codes)."""
    try:
        from ray.exceptions import RayError
    except ImportError:
        return exc
    for _ in range(5):  # an actor that died of a task error: two layers
        cause = getattr(exc, "cause", None)
        if not isinstance(exc, RayError) or not isinstance(cause, BaseException) or cause is exc:
            break
        exc = cause
    return exc


def describe_error(exc: BaseException) -> str:
    """`Type: message` of `plain_error(exc)`, without colour codes (what the store and the terminal show)."""
    plain = plain_error(exc)
    text = _ANSI.sub("", str(plain))
    if plain is not exc and "Traceback" in text:
        text = text.split("Traceback")[0].strip() or text
    return f"{dead_node_summary(text)}{type(plain).__name__}: {text}{dead_worker_log(text)}"


_ROLES = {"RolloutWorker": "the rollout worker", "TrainerWorker": "a trainer rank"}


def dead_node_summary(text: str) -> str:
    """A first line for an actor lost with its Ray node (a machine gone, preempted, its raylet stopped): which
    worker, which node, and what to do; "" for any other error."""
    node = re.search(r"its node has died\. Node Id: ([0-9a-f]+)", text)
    if node is None:
        return ""
    role = re.search(r"class_name: (\w+)", text)
    who = _ROLES.get(role.group(1), role.group(1)) if role else "a worker"
    return (
        f"{who} was lost with its Ray node {node.group(1)[:8]}: resume the job (miles jobs resume) once the "
        "cluster again holds what its resources: plan needs; Ray's report follows.\n"
    )


def dead_worker_log(text: str, lines: int = 25) -> str:
    """For a Ray actor whose process died (a crash, the OOM killer), the last lines of that process's stderr
    from Ray's session logs, which Ray's own message leaves out; "" when there is nothing to add."""
    if "worker process has died" not in text:
        return ""
    pid = re.search(r"\bpid: (\d+)", text)
    if pid is None:
        return ""
    tmp = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "session_latest" / "logs"
    for log in sorted(tmp.glob(f"worker-*-{pid.group(1)}.err")):
        try:
            tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-lines:]
        except OSError:
            continue
        if tail:
            return f"\n  last lines of that worker's stderr ({log}):\n" + "\n".join(f"    {line}" for line in tail)
    return ""
