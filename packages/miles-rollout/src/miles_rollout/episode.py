"""Token-faithful episodes: the ids of a multi-turn rollout exactly as the engine and the environment made them.

An episode is its prompt ids followed by segments: model turns (the ids the engine generated, with the logprobs
it reported and the weight versions it used) and environment turns (observations and tool results, tokenized
once). `Episode.to_sample` lays them out for the trainer unchanged: the trainer's input is the prompt ids and
every segment's ids in order, its loss mask covers the model's tokens only (environment tokens get mask 0 and a
placeholder logprob of 0.0 that no loss reads). Nothing is decoded and encoded again between engine and trainer, so
a mixture of experts' routing of the last model turn (it read every id before it) is the routing of the sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from miles_rollout.types import PromptRecord, Sample, SampleStatus

SegmentKind = Literal["model", "env"]

# Why an episode ended. `done`: the environment said so. `max_turns`, `max_tokens`: a limit of rollout.multi_turn.
# `length`: a model turn reached max_new_tokens (it has no end token; the episode cannot go on from there).
# `env_error`, `env_timeout`, `bad_observation`: the environment raised, ran past step_timeout_s, or returned an
# observation that is not text. `abort`: the engine aborted the request (a pause in abort mode).
END_REASONS = ("done", "max_turns", "max_tokens", "length", "env_error", "env_timeout", "bad_observation", "abort")
ENV_FAILURES = ("env_error", "env_timeout", "bad_observation")
_STATUS = {"abort": SampleStatus.ABORTED, "length": SampleStatus.TRUNCATED, "max_tokens": SampleStatus.TRUNCATED}


@dataclass
class Segment:
    """One turn's tokens. `logprobs` (model turns only) are the engine's, one per id."""

    kind: SegmentKind
    ids: list[int]
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)  # model turns: the version of each id
    num_messages: int = 0  # environment turns: how many transcript messages it stands for
    # model turns, a mixture of experts: the engine's routing of every id it read and generated but the last
    # ([positions, layers × top_k], GenerateResult.routed_experts), when it returned one
    routed_experts: Any = None
    # environment turns with images: the processor's inputs for them (`PromptEncoder.turn_inputs`)
    multimodal: dict[str, Any] | None = None


@dataclass
class Episode:
    """A multi-turn rollout in progress, then finished (`end_reason` set)."""

    prompt_ids: list[int]
    segments: list[Segment] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # the environment's, one per step
    messages: list[dict[str, Any]] = field(default_factory=list)  # the transcript, as text (for people and rewards)
    end_reason: str = ""
    error: str = ""  # what the environment raised, when end_reason is env_error / env_timeout / bad_observation
    # a prompt with images: the processor's inputs for it (`PromptEncoder.inputs`)
    prompt_multimodal: dict[str, Any] | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt and every segment: what the model's context must hold."""
        return len(self.prompt_ids) + sum(len(s.ids) for s in self.segments)

    @property
    def num_turns(self) -> int:
        return sum(s.kind == "model" for s in self.segments)

    def ids(self) -> list[int]:
        """Everything the model reads next: the prompt, then every segment in order."""
        return self.prompt_ids + [i for s in self.segments for i in s.ids]

    def multimodal(self) -> dict[str, Any] | None:
        """The image inputs of everything the model reads next (None without images): the prompt's and every
        environment turn's processor tensors in order, and `mm_token_type_ids` over `ids()` (0 on text ids)."""
        parts = [self.prompt_multimodal] + [s.multimodal for s in self.segments]
        if not any(parts):
            return None
        import torch

        lengths = [len(self.prompt_ids)] + [len(s.ids) for s in self.segments]
        out: dict[str, Any] = {"mm_token_type_ids": []}
        tensors: dict[str, list] = {}
        for part, length in zip(parts, lengths, strict=True):
            out["mm_token_type_ids"] += list(part["mm_token_type_ids"]) if part else [0] * length
            for key, value in (part or {}).items():
                if key != "mm_token_type_ids":
                    tensors.setdefault(key, []).append(value)
        return out | {key: torch.cat(values) for key, values in tensors.items()}

    def add_model(
        self,
        ids: list[int],
        logprobs: list[float],
        weight_versions: list[int],
        text: str,
        token_versions: list[int] | None = None,
        routed_experts: Any = None,
    ) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"a model turn of {len(ids)} ids came with {len(logprobs)} logprobs")
        if routed_experts is not None and len(routed_experts) != self.num_tokens + len(ids) - 1:
            raise ValueError(
                f"a model turn's routing covers {len(routed_experts)} positions; it read {self.num_tokens} ids and "
                f"generated {len(ids)}, so {self.num_tokens + len(ids) - 1} were routed"
            )
        per_id = list(token_versions) if token_versions and len(token_versions) == len(ids) else []
        segment = Segment("model", list(ids), text, list(logprobs), list(weight_versions), per_id)
        segment.routed_experts = routed_experts
        self.segments.append(segment)
        self.messages.append({"role": "assistant", "content": text})

    def add_env(self, ids: list[int], messages: list[dict[str, Any]], multimodal: dict[str, Any] | None = None) -> None:
        """An environment turn: its ids (with images, `multimodal`: the processor's inputs for them) and its messages
        (in the transcript with an image part as the text `[image]`)."""
        messages = [{**m, "content": transcript_text(m.get("content", ""))} for m in messages]
        text = "".join(m["content"] for m in messages)
        self.segments.append(Segment("env", list(ids), text, num_messages=len(messages), multimodal=multimodal))
        self.messages.extend(messages)

    def end(self, reason: str, error: str = "") -> None:
        if reason not in END_REASONS:
            raise ValueError(f"unknown end reason {reason!r}: one of {', '.join(END_REASONS)}")
        self.end_reason, self.error = reason, error

    def summary(self) -> dict[str, Any]:
        """What `Sample.metadata["episode"]` holds: JSON-ready, for episode rewards, metrics and the recorder."""
        return {
            "num_turns": self.num_turns,
            "end_reason": self.end_reason,
            "error": self.error,
            "env_reward": sum(self.rewards),
            "env_rewards": list(self.rewards),
            "messages": list(self.messages),
        }

    def drop_env(self) -> None:
        """Takes back the last environment turn (ids and transcript): the model never read it."""
        segment = self.segments.pop()
        assert segment.kind == "env", "drop_env: the last segment is the model's"
        del self.messages[len(self.messages) - segment.num_messages :]

    def to_sample(
        self, record: PromptRecord, group_index: int = 0, weight_version: int | None = None, drop_failed: bool = False
    ) -> Sample:
        """The trainer's view: response = every segment's ids, mask 1 on model ids and 0 on environment ids,
        logprobs the engine's (0.0 on environment ids). `response_text` is the last model turn's text (what a
        reward of a final answer reads); the whole transcript is in `metadata["episode"]`. An episode that ended
        before its first model turn (its environment failed to start, its prompt fills max_total_tokens) has
        nothing to train on: it is `aborted` (left out of the train batch), under `weight_version` (the engine's
        then), which it then requires. `drop_failed` (`rollout.multi_turn.env_failures: drop`): an episode its
        environment ended by failing is `aborted` too."""
        if not self.end_reason:
            raise ValueError("to_sample: the episode has not ended (call end(reason) first)")
        response: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        for segment in self.segments:
            response += segment.ids
            model = segment.kind == "model"
            mask += [int(model)] * len(segment.ids)
            logprobs += segment.logprobs if model else [0.0] * len(segment.ids)
        versions = sorted({v for s in self.segments for v in s.weight_versions})
        per_id: list[int] = []  # environment ids take the version of the model turn before them
        for segment in self.segments:
            if segment.kind == "model":
                first = segment.weight_versions[0] if segment.weight_versions else (versions or [0])[0]
                per_id += segment.token_versions or [first] * len(segment.ids)
            else:
                per_id += [per_id[-1] if per_id else (versions or [0])[0]] * len(segment.ids)
        status = _STATUS.get(self.end_reason, SampleStatus.COMPLETED)
        if drop_failed and self.end_reason in ENV_FAILURES:
            status = SampleStatus.ABORTED
        if not self.num_turns:
            if weight_version is None:
                raise ValueError("to_sample: an episode without a model turn needs the engine's weight_version")
            versions, status = [weight_version], SampleStatus.ABORTED
        last_turn = next((s for s in reversed(self.segments) if s.kind == "model"), None)
        last = last_turn.text if last_turn is not None else ""
        return Sample(
            group_index=group_index,
            prompt=record.prompt,
            label=record.label,
            prompt_ids=list(self.prompt_ids),
            response_ids=response,
            rollout_logprobs=logprobs,
            loss_mask=mask,
            response_text=last,
            status=status,
            weight_versions=versions,
            metadata={**record.metadata, "episode": self.summary()},
            token_versions=per_id if self.num_turns else [],
            # the last model turn read every id before it: its routing covers the sample up to its own last id (an
            # environment turn after it was never read, and keeps the trainer's own routing)
            routed_experts=last_turn.routed_experts if last_turn is not None else None,
            multimodal=self.multimodal(),
            images=list(record.images),
        )


def transcript_text(content: Any) -> str:
    """A message's content as the transcript keeps it: a text, or a list of parts whose images are `[image]`."""
    if not isinstance(content, list):
        return str(content)
    return "".join(
        str(p.get("text", "")) if p.get("type") == "text" else "[image]" for p in content if isinstance(p, dict)
    )


def _ids_error(ids: Any, vocab_size: int | None) -> str:
    if not isinstance(ids, list):
        return f" is a {type(ids).__name__}, not a list of ints"
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and (vocab_size is None or max(ids) < vocab_size)):
        return ""  # the common case, in C loops; the scan below names the first offending id
    for i, value in enumerate(ids):
        if isinstance(value, bool) or not isinstance(value, int):
            return f"[{i}] is {value!r} ({type(value).__name__}), not an int"
        if value < 0 or (vocab_size is not None and value >= vocab_size):
            return f"[{i}] is {value}, outside the vocabulary [0, {vocab_size})"
    return ""


def check_ids(ids: Any, vocab_size: int | None, where: str) -> None:
    """Raise ValueError naming `where` and the offending value unless `ids` is a list of ids in the vocabulary."""
    problem = _ids_error(ids, vocab_size)
    if problem:
        raise ValueError(where + problem)


def check_sample(sample: Any, vocab_size: int | None, where: str) -> Sample:
    """A sample a generate function returned, checked before it reaches the trainer; errors name `where` (the
    function's dotted path) and the offending field and value."""
    if not isinstance(sample, Sample):
        raise TypeError(f"{where} returned a {type(sample).__name__}, not a miles_rollout.Sample: {sample!r:.120}")
    check_ids(sample.prompt_ids, vocab_size, f"{where}: prompt_ids")
    check_ids(sample.response_ids, vocab_size, f"{where}: response_ids")
    if not sample.prompt_ids:
        raise ValueError(f"{where}: prompt_ids is empty")
    n = len(sample.response_ids)
    for name in ("rollout_logprobs", "loss_mask"):
        value = getattr(sample, name)
        if not isinstance(value, list) or len(value) != n:
            size = len(value) if isinstance(value, list) else type(value).__name__
            raise ValueError(f"{where}: {name} has {size} entries for {n} response ids")
    for i, (m, lp) in enumerate(zip(sample.loss_mask, sample.rollout_logprobs, strict=True)):
        if m not in (0, 1):
            raise ValueError(f"{where}: loss_mask[{i}] is {m!r}, not 0 or 1")
        if isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(lp) or (m and lp > 1e-6):
            raise ValueError(f"{where}: rollout_logprobs[{i}] is {lp!r}: a logprob is a finite number <= 0")
    if not sample.weight_versions:
        raise ValueError(f"{where}: weight_versions is empty (the engine results' weight_versions say which)")
    per_id = sample.token_versions
    if per_id and (not isinstance(per_id, list) or len(per_id) != n):
        size = len(per_id) if isinstance(per_id, list) else type(per_id).__name__
        raise ValueError(
            f"{where}: token_versions has {size} entries for {n} response ids (a list, one per id; set it to [] "
            "after changing response_ids, and every id counts as the oldest version)"
        )
    if per_id and not set(per_id) <= set(sample.weight_versions):
        raise ValueError(
            f"{where}: token_versions holds {sorted(set(per_id) - set(sample.weight_versions))}, which "
            f"weight_versions {sample.weight_versions} does not"
        )
    return sample
