"""`rollout.environment: {type: verifiers, id, args}`: a `verifiers` environment's episodes on Miles' engines.

verifiers (Prime Intellect, PyPI `verifiers`; Miles drives its classic API, `verifiers.legacy`, pinned at 0.3.1)
makes an environment with `load_environment(id, **args)`: a dataset of conversations, a parser and a rubric, and for
multi-turn and tool environments an `env_response(messages, state)` that answers each model turn. Miles runs the
environment's own rollout loop (its stop conditions, tool calls, final responses) with a `verifiers` client of its
own (`MilesClient`) in place of an OpenAI endpoint: every model turn is a token-in / token-out call of Miles' engine,
so the sample is exactly the ids the engine generated and the environment's turns tokenized once
(`miles_rollout.episode`), never a chat transcript tokenized again. Then the rubric scores the episode: its reward is
the episode's environment reward (`rollout.reward: env`, the default for these environments) and each rubric
function's score is kept in `metadata["verifiers"]["metrics"]` and reported per step as `reward/vf_<name>`.

Tool calls are read from the model's text in `rollout.multi_turn.tool_format` (hermes for Qwen2.5-style models) and
handed to the environment as the OpenAI-style `tool_calls` it expects; its tools are rendered by the chat template.
`rollout.multi_turn` limits every episode as it limits Miles' own (max_turns, max_total_tokens). The environment's
dataset comes through Miles' data path with `data.source: environment`.

Not supported: rubrics with group-level reward functions (Miles scores each episode as it ends; refused before
start) and environments that are not verifiers' `MultiTurnEnv` (`SingleTurnEnv`, `ToolEnv` and the others built on
it are). The environment's code runs in the rollout process's event loop, as verifiers runs it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import threading
import time
from dataclasses import replace
from typing import Any

from miles_rollout.config import VerifiersEnvironment
from miles_rollout.env import parse_tool_call
from miles_rollout.episode import Episode
from miles_rollout.plugin_check import plugin_dirs_on_path
from miles_rollout.types import FinishReason, PromptRecord, Sample, SampleStatus

INSTALL = "pip install 'miles-rollout[hubs]' (verifiers==0.3.1)"
_LOADED: dict[str, Any] = {}
_LOCK = threading.Lock()


def _vf() -> Any:
    try:
        import verifiers.legacy as vf
    except ImportError as exc:
        raise ValueError(f"rollout.environment: type verifiers needs PyPI verifiers: {INSTALL} ({exc})") from None
    return vf


def load(spec: VerifiersEnvironment) -> Any:
    """The environment of `spec`, made once per process; ValueError naming the field when its package is missing, it
    cannot be made, or Miles cannot drive it."""
    key = json.dumps([spec.id, spec.args], sort_keys=True, default=str)
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = _load(spec)
        return _LOADED[key]


def _load(spec: VerifiersEnvironment) -> Any:
    vf = _vf()
    plugin_dirs_on_path()  # the job file's folder, in every worker as in the driver
    module = spec.id.replace("-", "_").split("/")[-1]  # as verifiers names an id's module
    if importlib.util.find_spec(module) is None:
        raise ValueError(
            f"rollout.environment.id: no module {module!r} for the verifiers environment {spec.id!r}: install its "
            "package (`vf-install`, or pip) or put it in the job's plugin folders"
        )
    from verifiers.legacy.utils.env_utils import load_environment

    loader = getattr(importlib.import_module(module), "load_environment", None)
    if not callable(loader):
        raise ValueError(f"rollout.environment.id: the module {module!r} has no load_environment function")
    try:  # verifiers reports a wrong argument as a RuntimeError of the load; checked here to name the field
        inspect.signature(loader).bind(**spec.args)
    except TypeError as exc:
        raise ValueError(
            f"rollout.environment.args: load_environment of {spec.id!r} refused {spec.args}: {exc}"
        ) from None
    try:
        with _keep_signal_handlers():
            env = load_environment(spec.id, **spec.args)
    except TypeError as exc:
        raise ValueError(
            f"rollout.environment.args: load_environment of {spec.id!r} refused {spec.args}: {exc}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - the environment's own code, reported with the field
        raise ValueError(f"rollout.environment: loading {spec.id!r} failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(env, vf.MultiTurnEnv):
        raise ValueError(
            f"rollout.environment.id: {spec.id!r} is a {type(env).__name__}; Miles drives verifiers' MultiTurnEnv "
            "and the environments built on it (SingleTurnEnv, ToolEnv, ...)"
        )
    group = [getattr(f, "__name__", repr(f)) for f in _group_functions(env.rubric)]
    if group:
        raise ValueError(
            f"rollout.environment.id: the rubric of {spec.id!r} has group-level reward functions ({', '.join(group)}); "
            "Miles scores each episode as it ends"
        )
    return env


@contextlib.contextmanager
def _keep_signal_handlers():
    """verifiers' Environment installs SIGINT and SIGTERM handlers (a teardown, then KeyboardInterrupt or exit) as
    it is made: on the driver's main thread they would replace Miles' own (Ctrl-C stops a job before its next step),
    and off the main thread Python refuses them (a rollout actor makes the environment on another). So for the time
    of the call its module's `signal` is a stand-in whose `signal()` installs nothing: the process keeps its handlers,
    and verifiers' teardown still runs at exit (it registers it with atexit too)."""
    import signal as real

    import verifiers.legacy.envs.environment as module

    class _NoHandlers:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def signal(signum: int, handler: Any) -> Any:
            return real.getsignal(signum)

    module.signal = _NoHandlers()  # type: ignore[assignment]
    try:
        yield
    finally:
        module.signal = real


def _group_functions(rubric: Any) -> list[Any]:
    rubrics = getattr(rubric, "rubrics", None)
    if rubrics is not None:  # a RubricGroup
        return [f for r in rubrics for f in _group_functions(r)]
    return [f for f in rubric.funcs if rubric._is_group_func(f)]


def _plain(value: Any) -> Any:
    """A dataset value as JSON-ready Python (datasets hands back lists and dicts already; NumPy scalars aside)."""
    return json.loads(json.dumps(value, default=str))


def records(spec: VerifiersEnvironment, num_eval: int) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """`data.source: environment`: (training prompts, held-out prompts) from the environment's dataset, its eval
    dataset held out (or, without one, the last `num_eval` rows of the training set)."""
    env = load(spec)
    env.build_dataset()
    env.build_eval_dataset()
    train_rows = list(env.dataset) if env.dataset is not None else []
    eval_rows = list(env.eval_dataset) if env.eval_dataset is not None else []
    if not train_rows:
        train_rows, eval_rows = eval_rows, []
    if not eval_rows:
        if len(train_rows) <= num_eval:
            raise ValueError(
                f"data.num_eval: the verifiers environment {spec.id!r} has {len(train_rows)} rows and no eval "
                f"dataset, too few to hold out {num_eval}"
            )
        train_rows, eval_rows = train_rows[:-num_eval], train_rows[-num_eval:]
    return [_record(r, spec.id, i) for i, r in enumerate(train_rows)], [
        _record(r, spec.id, i) for i, r in enumerate(eval_rows)
    ]


def _record(row: dict[str, Any], env_id: str, index: int) -> PromptRecord:
    prompt = _plain(row.get("prompt"))
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"data.source: row {index} of {env_id!r} has no prompt (a text or a list of messages)")
    messages = [{"role": str(m.get("role")), "content": _text(m.get("content"))} for m in prompt]
    users = [m["content"] for m in messages if m["role"] == "user"]
    extra = {k: _plain(row[k]) for k in ("info", "task", "example_id") if k in row and row[k] is not None}
    return PromptRecord(
        users[-1] if users else messages[-1]["content"],
        "" if row.get("answer") is None else str(row["answer"]),
        {"verifiers": extra},
        messages,
    )


def _text(content: Any) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    if isinstance(content, list):  # content parts (dicts, or verifiers' own part objects): the text ones
        return "".join(str(p.get("text", "") if isinstance(p, dict) else getattr(p, "text", "") or "") for p in content)
    return str(content)


def _message(message: Any) -> dict[str, Any]:
    role = getattr(message, "role", None) or message.get("role")
    content = getattr(message, "content", None) if not isinstance(message, dict) else message.get("content")
    return {"role": str(role), "content": _text(content)}


class _Stop(Exception):
    """Why Miles ended an episode the environment had not ended (a limit, the engine)."""


def _client_class() -> type:
    vf = _vf()
    from verifiers.legacy.clients.client import Client

    class MilesClient(Client):
        """A verifiers client whose model is Miles' engine, token in / token out; it builds the episode's sample."""

        def __init__(self, engine_client: Any, ctx: Any, sampling: Any, record: PromptRecord, request_id: str) -> None:
            super().__init__(engine_client)
            self.ctx, self.sampling, self.record, self.request_id = ctx, sampling, record, request_id
            self.episode: Episode | None = None
            self.seen = 0  # messages of the conversation the episode's ids already hold
            self.model_end = ""
            self.stop = ""  # a Miles end reason, when Miles ended the episode
            self.cut = False

        # verifiers' abstract hooks: this client answers get_response itself, so none of them is reached
        def setup_client(self, config: Any) -> Any:
            raise NotImplementedError

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> Any:
            return messages, {}

        async def get_native_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def from_native_response(self, response: Any) -> Any:
            return response

        async def close(self) -> None:
            return None

        def _end(self, reason: str) -> None:
            self.stop = reason
            raise vf.OverlongPromptError(reason)  # verifiers' own way out of its loop: the episode is then scored

        async def get_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None, **kwargs: Any):
            limits = self.ctx.config.multi_turn
            messages = [_message(m) for m in prompt]
            schemas = (
                [
                    {
                        "type": "function",
                        "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
                    }
                    for t in tools
                ]  # fmt: skip
                if tools
                else None
            )
            if self.stop:
                self._end(self.stop)
            if self.cut:  # the last turn has no end token: the episode cannot go on from there
                self._end("length")
            if self.episode is None:
                record = replace(self.record, messages=messages)
                self.episode = Episode(self.ctx.encoder.encode(record, schemas))
            else:
                if len(messages) <= self.seen:
                    raise vf.Error(f"the environment's next prompt has {len(messages)} messages, not more than the "
                                   f"{self.seen} the episode holds: Miles needs a conversation that only grows")  # fmt: skip
                if self.episode.num_turns >= limits.max_turns:
                    self._end("max_turns")
                new = messages[self.seen :]
                self.episode.add_env(self.ctx.encoder.turn_ids(new, schemas, self.model_end), new)
            room = limits.max_total_tokens - self.episode.num_tokens
            if room <= 0:
                if self.episode.num_turns:
                    self.episode.drop_env()  # no room for the model to answer: neither trained on nor shown
                self._end("max_tokens")
            sampling = (
                self.sampling if self.sampling.max_new_tokens <= room else replace(self.sampling, max_new_tokens=room)
            )
            turn = self.episode.num_turns
            result = await self.client.generate(self.episode.ids(), sampling, request_id=f"{self.request_id}-t{turn}")
            text = self.ctx.tokenizer.decode(result.output_ids, skip_special_tokens=True)
            self.episode.add_model(
                result.output_ids, result.output_logprobs, result.weight_versions, text, result.versions_per_token(),
                result.routed_experts,
            )  # fmt: skip
            self.seen = len(messages) + 1
            self.model_end = self.ctx.tokenizer.decode(result.output_ids[-1:]) if result.output_ids else ""
            if result.finish_reason == FinishReason.ABORT:  # the partial turn goes to neither environment nor rubric
                self._end("abort")
            self.cut = result.finish_reason == FinishReason.LENGTH
            if self.cut and sampling is not self.sampling:
                self.stop = "max_tokens"
            call = parse_tool_call(text, limits.tool_format)
            calls = (
                [vf.ToolCall(id=f"call_{turn}", name=call.name, arguments=json.dumps(call.arguments))] if call else None
            )
            finish = "tool_calls" if calls else ("length" if self.cut else "stop")
            n_in, n_out = len(self.episode.ids()) - len(result.output_ids), len(result.output_ids)
            return vf.Response(
                id=f"{self.request_id}-t{turn}", created=int(time.time()), model=model,
                usage=vf.Usage(prompt_tokens=n_in, reasoning_tokens=0, completion_tokens=n_out, total_tokens=n_in + n_out),
                message=vf.ResponseMessage(content=text, tool_calls=calls, finish_reason=finish, is_truncated=self.cut),
            )  # fmt: skip

    return MilesClient


_CLIENT: type | None = None


async def run_episode(record: PromptRecord, client: Any, sampling: Any, ctx: Any) -> Sample:
    """One episode of the job's verifiers environment on `client` (Miles' engine), scored by its rubric."""
    global _CLIENT
    spec = ctx.config.environment
    env = load(spec)
    if _CLIENT is None:
        _CLIENT = _client_class()
    request_id = f"{ctx.group_index}-{ctx.sample_index}"
    vf_client = _CLIENT(client, ctx, sampling, record, request_id)
    row = dict(record.metadata.get("verifiers") or {})
    task_input = {
        "prompt": record.messages or [{"role": "user", "content": record.prompt}],
        "answer": record.label,
        "example_id": row.get("example_id", 0),
        **({"info": row["info"]} if "info" in row else {}),
        **({"task": row["task"]} if "task" in row else {}),
    }
    version = client.engine.weight_version
    state: Any = None
    failure = ""
    try:
        state = await env.rollout(task_input, vf_client, "miles", {})
        await env.rubric.score_rollout(state)
        await env.rubric.cleanup(state)
    except Exception as exc:  # noqa: BLE001 - the environment's own code (env_response, a parser, a rubric function)
        failure = f"{type(exc).__name__}: {exc}"[:500]  # ends this episode only, as in Miles' own runner
    episode = vf_client.episode
    if episode is None:  # ended before its first model turn: nothing to train on
        error = state.get("error") if state is not None else None
        episode = Episode(ctx.encoder.encode(record))
        episode.end("env_error", failure or (f"{type(error).__name__}: {error}"[:500] if error else "no model turn"))
        sample = episode.to_sample(record, ctx.group_index, version)
        sample.metadata.pop("verifiers", None)
        return sample
    if episode.segments[-1].kind == "env":  # an environment turn no model turn answered: not trained on
        episode.drop_env()
    reason, detail = _end_reason(vf_client, state, failure)
    episode.end(reason, detail)
    scored = state is not None and not failure
    if scored:
        episode.rewards.append(float(state.get("reward") or 0.0))
    drop = ctx.config.multi_turn.env_failures == "drop"
    sample = episode.to_sample(record, ctx.group_index, version, drop_failed=drop)
    sample.metadata.pop("verifiers", None)
    if scored and sample.status != SampleStatus.ABORTED:  # what was not scored stays unmeasured, not 0
        metrics = {k: float(v) for k, v in (state.get("metrics") or {}).items() if isinstance(v, int | float)}
        sample.metadata["verifiers"] = {"metrics": metrics, "stop": state.get("stop_condition")}
    return sample


# verifiers' stop conditions with a Miles end reason of their own (the others: the environment ended it, `done`)
_STOPS = {"timeout_reached": "env_timeout", "max_turns_reached": "max_turns", "has_error": "env_error"}


def _end_reason(vf_client: Any, state: Any, failure: str) -> tuple[str, str]:
    if failure:
        return "env_error", failure
    if vf_client.stop:  # a limit of Miles' (max_turns, max_tokens, length) or the engine's abort
        return vf_client.stop, ""
    stop = state.get("stop_condition")
    error = state.get("error")
    if stop in _STOPS:
        detail = f"{type(error).__name__}: {error}"[:500] if error is not None else f"verifiers: {stop}"
        return _STOPS[stop], detail
    if vf_client.cut:
        return "length", ""
    return "done", ""


def verifiers_metrics(samples: list[Sample]) -> dict[str, float]:
    """Each rubric function's mean score over a step's scored episodes (`reward/vf_<name>`): an episode the rubric
    did not score (its environment failed, it never reached the model, it was aborted) is left out, not counted as 0;
    none without verifiers."""
    scored = [s.metadata["verifiers"]["metrics"] for s in samples if isinstance(s.metadata.get("verifiers"), dict)]
    names = sorted({name for m in scored for name in m})
    return {f"reward/vf_{n}": sum(m[n] for m in scored if n in m) / sum(n in m for m in scored) for n in names}
