"""The judge model (`rollout.judge`) and the hub environments of `rollout.environment`. Imports only pydantic."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from miles_rollout.engine_config import _Strict


class JudgeConfig(_Strict):
    """A judge model (`rollout.reward: judge`): served by an engine of its own in the rollout process (its weights
    are never pushed to), it reads `template` filled with each sample's question, reference and answer, and its
    verdict (a score, or one of `choices`) is the reward."""

    model: str = Field(
        min_length=1,
        description="The judge: a model folder (Hugging Face layout), or `policy` for a frozen copy of the job's "
        "starting model.",
    )
    engine: Literal["hf", "sglang"] = Field(
        "hf",
        description="Its engine, with that engine's default settings: hf (in-process), or sglang (servers of its own).",
    )
    template: str = Field(
        min_length=1,
        description="The judge's prompt with {question}, {reference} (the record's label) and {answer} (the "
        "response) to fill; {answer} is required, other fields are refused. Literal braces are written {{ }}.",
    )
    chat_template: bool = Field(
        True, description="Render the prompt as one user turn with the judge tokenizer's chat template (if it has one)."
    )
    verdict: Literal["score", "choice"] = Field(
        "score",
        description="score: the first number in the judge's output, clipped to [score_min, score_max] and scaled to "
        "[0, 1]; choice: the first of `choices` it writes (a whole word), worth its value.",
    )
    score_min: float = Field(0.0, ge=-1e9, le=1e9, description="verdict score: the lowest score, reward 0.")
    score_max: float = Field(10.0, ge=-1e9, le=1e9, description="verdict score: the highest score, reward 1.")
    choices: dict[str, float] = Field(
        default_factory=dict, description="verdict choice: each answer the judge may write and its reward."
    )
    default: float = Field(
        0.0,
        ge=-1e6,
        le=1e6,
        description="The reward of a verdict that does not parse (counted in reward/judge_unparsed).",
    )
    max_new_tokens: int = Field(16, gt=0, le=4096, description="Tokens of one verdict (greedy).")

    @model_validator(mode="after")
    def _template_and_verdict(self) -> JudgeConfig:
        mark = "\u2063answer\u2063"  # what no template writes: shows where {answer} lands
        try:
            filled = self.template.format(question="", reference="", answer=mark)
        except KeyError as exc:
            raise ValueError(
                f"template: unknown field {{{exc.args[0]}}}; it may use {{question}}, {{reference}}, {{answer}}"
            ) from None
        except (ValueError, IndexError) as exc:
            raise ValueError(f"template: {exc} (literal braces are written {{{{ and }}}})") from None
        if mark not in filled:
            raise ValueError("template: has no {answer} field: the judge would never see the response it judges")
        if self.verdict == "choice" and not self.choices:
            raise ValueError("choices: verdict choice needs at least one answer and its reward, e.g. {yes: 1, no: 0}")
        if self.verdict == "score" and self.score_max <= self.score_min:
            raise ValueError(f"score_max: {self.score_max} is not above score_min {self.score_min}")
        return self


class VerifiersEnvironment(_Strict):
    """An environment of Prime Intellect's `verifiers` (PyPI `verifiers`, its classic API): `load_environment(id,
    **args)` makes it; its episodes run on Miles' engines through its own rollout loop, its rubric scores them."""

    type: Literal["verifiers"]
    id: str = Field(
        min_length=1,
        description="The environment's id, as `vf-install` names it: the module `id` (dashes read as underscores) "
        "with a `load_environment` function, installed or in the job's plugin folders.",
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of its load_environment.")


class OpenEnvEnvironment(_Strict):
    """An environment served by Meta's OpenEnv (PyPI `openenv`): Miles starts its server as a local process (`app`)
    or attaches to one (`url`), and holds one WebSocket session per episode."""

    type: Literal["openenv"]
    app: str | None = Field(
        None,
        description="The server's ASGI app as `module:attribute` (what `uvicorn module:attribute` serves, made with "
        "openenv's create_app); Miles starts it on a free local port, one per rollout process, and restarts it when "
        "it dies.",
    )
    url: str | None = Field(None, description="An OpenEnv server already running (http:// or https://).")
    action_field: str = Field(
        "message", min_length=1, description="The action's field that holds the model's text (EchoAction: message)."
    )
    action_args: dict[str, Any] = Field(default_factory=dict, description="Fixed fields of every action besides it.")
    observation_field: str | None = Field(
        None,
        description="The observation's field shown to the model as its next user turn; None: the observation's "
        "fields other than reward, done and metadata, as JSON.",
    )
    reset_args: dict[str, Any] = Field(default_factory=dict, description="Sent with every reset (seed, task, ...).")
    start_timeout_s: float = Field(60.0, gt=0, le=3600, description="How long a started server may take to answer.")
    retries: int = Field(
        1, ge=0, le=10, description="Retries of an episode's failed reset (a dead server is started again first)."
    )
    max_sessions: int = Field(
        1,
        ge=1,
        le=4096,
        description="Sessions open at once on the server (its create_app max_concurrent_envs; OpenEnv's default is "
        "1): more episodes wait for a free one.",
    )

    @model_validator(mode="after")
    def _one_server(self) -> OpenEnvEnvironment:
        if (self.app is None) == (self.url is None):
            raise ValueError("give app (a server Miles starts) or url (one running), not both and not neither")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: {self.url!r} is not an http:// or https:// URL")
        if self.app is not None and ":" not in self.app:
            raise ValueError(f"app: {self.app!r} is not `module:attribute`")
        return self


HubEnvironment = Annotated[VerifiersEnvironment | OpenEnvEnvironment, Field(discriminator="type")]
