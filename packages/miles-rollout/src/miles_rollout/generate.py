"""Generate functions: how one prompt record becomes samples. `rollout.generate` picks one.

- `single_turn` (the default): the prompt's ids in, one completion out, every token trained on.
- `multi_turn`: an episode with the environment of `rollout.environment` (`miles_rollout.env`): model turn,
  environment turn, ... until the environment is done or a limit of `rollout.multi_turn` is reached.
- a dotted path `package.module:function` to your own: `async def fn(record, client, sampling, ctx)` returning a
  `Sample` or a list of them. `client.generate(ids, sampling)` is the engine, token-in/token-out; `ctx` is a
  `GenerateContext` (the tokenizer, the prompt encoder, the configuration, a new environment per call of
  `ctx.new_environment()`). `miles_rollout.episode.Episode` builds a token-faithful multi-turn sample.

The manager calls the function once per sample (`num_samples_per_prompt` times per record, all concurrently)
and checks what it returns (`episode.check_sample`): errors name the function's dotted path and the value.
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
import queue
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from miles_rollout.config import RolloutConfig
from miles_rollout.engine_client import EngineClient
from miles_rollout.env import Action, StepResult, environment_factory, parse_tool_call
from miles_rollout.episode import Episode, transcript_text
from miles_rollout.images import ImageError
from miles_rollout.plugin_check import resolve_named
from miles_rollout.prompts import PromptEncoder
from miles_rollout.types import FinishReason, PromptRecord, Sample, SampleStatus, SamplingParams, status_of

GenerateFn = Callable[[PromptRecord, EngineClient, SamplingParams, "GenerateContext"], Awaitable[Any]]


@dataclass
class GenerateContext:
    """What a generate function may use besides the engine."""

    tokenizer: Any
    encoder: PromptEncoder
    config: RolloutConfig
    group_index: int = 0
    sample_index: int = 0
    make_environment: Callable[[], Any] | None = None

    def new_environment(self) -> Any:
        """A fresh environment from `rollout.environment` (ValueError when none is configured)."""
        if self.make_environment is None:
            raise ValueError("rollout.environment is not set: this generate function needs an environment")
        return self.make_environment()


async def single_turn(record: PromptRecord, client: EngineClient, sampling: SamplingParams, ctx: GenerateContext):
    """One completion of the prompt; the built-in default."""
    prompt_ids, multimodal = ctx.encoder.inputs(record)
    request_id = f"{ctx.group_index}-{ctx.sample_index}"
    result = await client.generate(
        prompt_ids, sampling, request_id=request_id, **({"multimodal": multimodal} if multimodal else {})
    )
    return Sample(
        group_index=ctx.group_index,
        prompt=record.prompt,
        label=record.label,
        prompt_ids=prompt_ids,
        response_ids=result.output_ids,
        rollout_logprobs=result.output_logprobs,
        loss_mask=[1] * len(result.output_ids),
        response_text=ctx.tokenizer.decode(result.output_ids, skip_special_tokens=True),
        status=status_of(result.finish_reason),
        weight_versions=result.weight_versions,
        metadata=dict(record.metadata),
        token_versions=result.versions_per_token(),
        routed_experts=result.routed_experts,
        multimodal=multimodal,
        images=list(record.images),
    )


class _EnvThread:
    """Where one episode's environment runs: `await call(fn, *args)` awaits a coroutine function in the loop and
    runs a plain one on this episode's own daemon thread, the same thread for every call of the episode (its
    construction, reset and steps), so an environment may hold what belongs to a thread (a sqlite connection, a
    client that is not thread-safe). Not the event loop's executor: a slow step does not stop the other episodes,
    step_timeout_s still ends its episode, and one that never returns holds neither the executor's threads (the
    hf engine decodes there) nor the end of the rollout (`asyncio.run` waits for the executor, not for this
    thread). `close()` lets the thread end once what it runs returns."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def call(self, fn: Callable, *args: Any) -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, daemon=True, name="miles-env")
            self._thread.start()
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._jobs.put((fn, args, loop, future))
        result = await future
        return await result if inspect.isawaitable(result) else result

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, loop, future = job
            try:
                value, error = fn(*args), None
            except BaseException as exc:  # handed to the episode, which records it
                value, error = None, exc
            try:
                loop.call_soon_threadsafe(_settle, future, value, error)
            except RuntimeError:  # the loop has closed: the episode ended long ago
                pass


def _settle(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if not future.done():  # a step that ran past step_timeout_s: its episode has ended (the future is cancelled)
        future.set_exception(error) if error is not None else future.set_result(value)


def _as_messages(observation: Any, role: str, parts: bool = False) -> list[dict[str, Any]] | None:
    """An observation as messages, or None when it is neither a text nor a list of {role, content} messages whose
    content is a text (or, with `parts`, a list of text and image parts: `{"type": "text", "text": ...}`,
    `{"type": "image", "image": <bytes of an image file | PIL image>}`)."""
    if isinstance(observation, str):
        return [{"role": role, "content": observation}]
    if isinstance(observation, list) and observation:
        ok = all(isinstance(m, dict) and isinstance(m.get("role"), str)
                 and (isinstance(m.get("content"), str) or (parts and _parts(m.get("content"))))
                 for m in observation)  # fmt: skip
        return [dict(m) for m in observation] if ok else None
    return None


def _parts(content: Any) -> bool:
    """A content given as a non-empty list of text and image parts."""
    if not isinstance(content, list) or not content:
        return False
    return all(isinstance(p, dict) and ((p.get("type") == "text" and isinstance(p.get("text"), str))
               or (p.get("type") == "image" and p.get("image") is not None)) for p in content)  # fmt: skip


async def multi_turn(record: PromptRecord, client: EngineClient, sampling: SamplingParams, ctx: GenerateContext):
    """An episode with a new environment: model and environment take turns until the environment is done, or
    `rollout.multi_turn` limits it (max_turns, max_total_tokens: the prompt and every turn). A failing
    environment (it raises, times out, answers with something that is not text) ends only its episode, with the
    reason in `metadata["episode"]`; the step goes on. A verifiers environment runs its own loop on this engine
    (`miles_rollout.hubs.verifiers_env`)."""
    if getattr(ctx.config.environment, "type", None) == "verifiers":
        from miles_rollout.hubs.verifiers_env import run_episode

        return await run_episode(record, client, sampling, ctx)
    worker = _EnvThread()
    try:
        return await _run_episode(record, client, sampling, ctx, worker)
    finally:
        worker.close()


async def _run_episode(
    record: PromptRecord, client: EngineClient, sampling: SamplingParams, ctx: GenerateContext, worker: _EnvThread
) -> Sample:
    limits = ctx.config.multi_turn
    env = await worker.call(ctx.new_environment)  # on the thread that runs its methods
    try:
        return await _episode_of(env, record, client, sampling, ctx, worker)
    finally:
        close = getattr(env, "close", None)
        if callable(close):  # an environment holding a session (OpenEnv's): closed with its episode
            try:
                await asyncio.wait_for(worker.call(close), limits.step_timeout_s)
            except Exception:  # noqa: BLE001 - the episode is over; a close that fails loses nothing of it
                pass


async def _episode_of(
    env: Any, record: PromptRecord, client: EngineClient, sampling: SamplingParams, ctx: GenerateContext,
    worker: _EnvThread,
) -> Sample:  # fmt: skip
    limits = ctx.config.multi_turn
    drop_failed = limits.env_failures == "drop"
    path = ctx.config.environment
    tools = getattr(env, "tools", None) or None
    version = client.engine.weight_version  # of an episode that ends before its first model turn (aborted)
    try:
        first = await asyncio.wait_for(worker.call(env.reset, record), limits.step_timeout_s)
    except asyncio.TimeoutError:
        error = f"reset() ran past rollout.multi_turn.step_timeout_s ({limits.step_timeout_s} s)"
        return _no_turn(ctx, record, tools, version, "env_timeout", error)
    except Exception as exc:  # the environment could not start: this episode only
        return _no_turn(ctx, record, tools, version, "env_error", f"reset(): {type(exc).__name__}: {exc}"[:500])
    if isinstance(first, str):
        record = replace(record, prompt=first, messages=None)
    elif first is not None:
        messages = _as_messages(first, "user")
        if messages is None:
            raise TypeError(f"{path}: reset() returned {first!r:.120}: expected None, a text or a list of messages")
        record = replace(record, prompt=messages[-1]["content"], messages=messages)
    prompt_ids, prompt_multimodal = ctx.encoder.inputs(record, tools)
    episode = Episode(prompt_ids, prompt_multimodal=prompt_multimodal)
    if episode.num_tokens >= limits.max_total_tokens:
        error = (
            f"the prompt is {episode.num_tokens} tokens, rollout.multi_turn.max_total_tokens {limits.max_total_tokens}"
        )
        episode.end("max_tokens", error)
        return episode.to_sample(record, ctx.group_index, version)
    request_id = f"{ctx.group_index}-{ctx.sample_index}"
    for turn in range(limits.max_turns):
        room = limits.max_total_tokens - episode.num_tokens
        if room <= 0:
            episode.end("max_tokens")
            break
        turn_sampling = sampling if sampling.max_new_tokens <= room else replace(sampling, max_new_tokens=room)
        images = episode.multimodal()
        result = await client.generate(
            episode.ids(),
            turn_sampling,
            request_id=f"{request_id}-t{turn}",
            **({"multimodal": images} if images else {}),
        )
        text = ctx.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        episode.add_model(
            result.output_ids, result.output_logprobs, result.weight_versions, text, result.versions_per_token(),
            result.routed_experts,
        )  # fmt: skip
        if result.finish_reason == FinishReason.ABORT:
            episode.end("abort")
            break
        cut = result.finish_reason == FinishReason.LENGTH  # shown to the environment for its reward, then the end
        action = Action(text, parse_tool_call(text, limits.tool_format))
        try:
            step = await asyncio.wait_for(worker.call(env.step, action), limits.step_timeout_s)
        except asyncio.TimeoutError:
            episode.end("env_timeout", f"step() ran past rollout.multi_turn.step_timeout_s ({limits.step_timeout_s} s)")
            break
        except Exception as exc:  # the environment's (or its tool's) failure ends this episode only
            episode.end("env_error", f"{type(exc).__name__}: {exc}"[:500])
            break
        if not isinstance(step, StepResult):
            raise TypeError(f"{path}: step() returned {step!r:.120}: expected a miles_rollout.env.StepResult")
        if isinstance(step.reward, bool) or not isinstance(step.reward, numbers.Real):
            raise TypeError(f"{path}: step() returned reward={step.reward!r:.80}: expected a number")
        episode.rewards.append(float(step.reward))
        if cut:  # the turn has no end token: the episode cannot go on from there
            episode.end("max_tokens" if turn_sampling is not sampling else "length")
            break
        if step.done and not step.observation:
            episode.end("done")
            break
        messages = _as_messages(step.observation, "tool" if action.tool_call else "user", parts=True)
        if messages is None:
            episode.end("bad_observation", f"step() observation {step.observation!r:.200}")
            break
        if step.done:
            # the last word is the environment's: in the transcript (an image as `[image]`), not trained
            episode.messages.extend({**m, "content": transcript_text(m["content"])} for m in messages)
            episode.end("done")
            break
        if turn == limits.max_turns - 1:
            episode.end("max_turns")
            break
        model_end = ctx.tokenizer.decode(result.output_ids[-1:]) if result.output_ids else ""
        try:
            ids, turn_multimodal = ctx.encoder.turn_inputs(messages, tools, model_end)
        except Exception as exc:
            # an image the environment sent that cannot be read or processed (a shape the processor refuses): this
            # episode ends, counted; a text turn's failure (the chat template's) still fails the job
            if not isinstance(exc, ImageError) and not any(isinstance(m["content"], list) for m in messages):
                raise
            episode.end("bad_observation", f"{type(exc).__name__}: {exc}"[:500])
            break
        episode.add_env(ids, messages, turn_multimodal)
        if episode.num_tokens >= limits.max_total_tokens:
            episode.drop_env()  # no room for the model to answer: neither trained on nor in the transcript
            episode.end("max_tokens")
            break
    else:  # max_turns == 0 cannot happen (validated); keeps the loop's contract explicit
        episode.end("max_turns")
    return episode.to_sample(record, ctx.group_index, drop_failed=drop_failed)


def _no_turn(ctx: GenerateContext, record: PromptRecord, tools: Any, version: int, reason: str, error: str) -> Sample:
    prompt_ids, prompt_multimodal = ctx.encoder.inputs(record, tools)
    episode = Episode(prompt_ids, prompt_multimodal=prompt_multimodal)
    episode.end(reason, error)
    return episode.to_sample(record, ctx.group_index, version)


async def supervised(record: PromptRecord, client: EngineClient, sampling: SamplingParams, ctx: GenerateContext):
    """Supervised fine-tuning (`kind: sft`): the record's response (its label) is the sample, teacher-forced; the
    engine is not called (it generates only for the held-out evaluation). The response is the label's tokens and the
    tokenizer's EOS, all of them trained; the rollout logprobs are unknown (0), so no off-policy correction applies."""
    prompt_ids = ctx.encoder.encode(record)
    response_ids = list(ctx.tokenizer.encode(record.label, add_special_tokens=False))
    eos = ctx.tokenizer.eos_token_id
    if eos is not None:
        response_ids.append(int(eos))
    if not response_ids:
        raise ValueError(f"generate supervised: the response of {record.prompt[:60]!r} is empty")
    return Sample(
        group_index=ctx.group_index,
        prompt=record.prompt,
        label=record.label,
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        rollout_logprobs=[0.0] * len(response_ids),
        loss_mask=[1] * len(response_ids),
        response_text=record.label,
        status=SampleStatus.COMPLETED,
        weight_versions=[client.engine.weight_version],
        metadata=dict(record.metadata),
    )


BUILTIN: dict[str, GenerateFn] = {"single_turn": single_turn, "multi_turn": multi_turn, "supervised": supervised}


def resolve_generate(name_or_path: str) -> GenerateFn:
    """A built-in name or a dotted path to an `async def` taking (record, client, sampling, ctx)."""
    fn = resolve_named(
        name_or_path, BUILTIN, f"rollout.generate: unknown {name_or_path!r}: built-in are {sorted(BUILTIN)}"
    )
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(
            f"rollout.generate: {name_or_path!r} is a {type(fn).__name__}, not an async function "
            "(async def fn(record, client, sampling, ctx))"
        )
    return fn


def make_context(config: RolloutConfig, tokenizer: Any, encoder: PromptEncoder) -> GenerateContext:
    """The context shared by a manager's calls (each call gets a copy with its indices)."""
    return GenerateContext(tokenizer, encoder, config, make_environment=make_environment(config))


def make_environment(config: RolloutConfig) -> Callable[[], Any] | None:
    """The factory of one environment per episode: a dotted path's, or an OpenEnv server's sessions (a verifiers
    environment runs its own loop: None)."""
    env = config.environment
    if env is None or getattr(env, "type", None) == "verifiers":
        return None
    if isinstance(env, str):
        return environment_factory(env, config.environment_args)
    from miles_rollout.config import OpenEnvEnvironment
    from miles_rollout.hubs.openenv_env import session_factory

    assert isinstance(env, OpenEnvEnvironment)
    return session_factory(env)
