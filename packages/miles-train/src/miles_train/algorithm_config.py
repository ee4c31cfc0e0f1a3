"""The `train.algorithm` section: the objective and the loss terms every objective combines with it. Imports only
pydantic (with miles_sync's spec base), so a job spec validates without torch; `miles_train.config` composes it
into `TrainConfig`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from miles_sync.config import SpecModel


class _Strict(SpecModel):
    """A section of the job spec: unknown fields, inf/NaN and booleans for numbers are refused (miles_sync.config)."""


ALGORITHMS = ("grpo", "dr_grpo", "gspo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo", "distill", "sft")
RL_ALGORITHMS = ALGORITHMS[:7]  # what `miles bench algorithms` compares by default (distill needs a teacher)
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


class AlgorithmConfig(_Strict):
    """The algorithm, in one section: the objective (how advantages are estimated, the policy loss, how per-token
    losses are aggregated) and the loss terms every objective combines with it: the ratio's clipping, the KL to the
    reference, the entropy bonus, the corrections of off-policy and mismatched rollouts (TIS, MIS, staleness), and
    the minibatches of a step. (Specs written before this section held the shared settings in `train.grpo`: they
    still load, with a deprecation warning.)"""

    name: str = Field(
        "grpo",
        description="A built-in (grpo: group mean and std; dr_grpo: group mean, no std, sequence-sum aggregation; "
        "gspo: sequence-level ratio and clipping; rloo: leave-one-out baseline; reinforce_pp: REINFORCE++ with "
        "token returns normalised over the global batch and the KL in the reward; reinforce_pp_baseline: the same "
        "after subtracting each group's mean reward; ppo: PPO with a learned critic (train.critic) and GAE, the KL in "
        "the reward; distill: on-policy distillation, each token's advantage the "
        "teacher's log-probability of it less the student's (the per-token reverse KL to train.teacher); sft: the "
        "negative log-likelihood of the responses, for `kind: sft`), or a dotted path `package.module:Name` to a "
        "user objective "
        "class with the same contract (miles_train.objectives.Objective).",
    )
    aggregation: Aggregation | None = Field(
        None,
        description="How per-token losses become one loss: token_mean (every token of the minibatch weighs the same), "
        "seq_mean_token_mean (each sequence's token mean, averaged over sequences), seq_mean_token_sum (each "
        "sequence's token sum, averaged over sequences). Denominators count the whole minibatch on every rank, so a "
        "split batch gives the unsplit loss. None: the algorithm's own (token_mean; dr_grpo seq_mean_token_sum; gspo "
        "seq_mean_token_mean).",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description="Estimator of KL(π‖π_ref) per token, Δ = log π_ref − log π: k1 = −Δ, k2 = Δ²/2, "
        "k3 = e^Δ − Δ − 1. Weighted by kl_coef (0: no reference model, no KL).",
    )
    kl_in_reward: bool | None = Field(
        None,
        description="Put the KL into the reward (computed from the old policy, no gradient) instead of the loss: "
        "each sequence's reward loses kl_coef × its summed KL (reinforce_pp: each token's reward loses kl_coef × its "
        "KL). None: the algorithm's own (true for reinforce_pp, reinforce_pp_baseline and ppo, false otherwise).",
    )
    entropy_coef: float = Field(
        0.0, ge=0, description="Entropy bonus: the loss loses entropy_coef × the policy's per-token entropy."
    )
    dual_clip: float | None = Field(
        None,
        gt=1,
        description="Dual-clip PPO: for negative advantages the loss is capped at dual_clip × |A| (a large ratio on "
        "a bad sample cannot blow up the update). None: off.",
    )
    clip_eps: float = Field(0.2, gt=0)
    clip_eps_high: float | None = Field(None, gt=0, description="Upper clip; None uses clip_eps.")
    normalize_std: bool = Field(
        True, description="grpo: divide advantages by the group's standard deviation (the other algorithms ignore it)."
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the KL to the frozen reference (train.algorithm.kl_estimator, in the loss or the "
        "reward: kl_in_reward); 0 = no reference model.",
    )
    old_logprobs: Literal["auto", "rollout", "recompute"] = Field(
        "auto",
        description="Behaviour logprobs of the ratio's denominator: the engine's (rollout), or recomputed by the "
        "trainer under the weights as pushed (recompute: removes the engine's numerical difference from the ratio). "
        "auto: recompute when the engines hold the weights in another dtype than the trainer's master weights "
        "(a bf16 checkpoint) or tis_cap is set, rollout otherwise.",
    )
    num_minibatches: int = Field(1, ge=1, description="Optimizer steps per batch.")
    mis_band: tuple[float, float] | None = Field(
        None,
        description="Masked importance sampling: tokens whose ratio π_old/π_rollout falls outside [low, high] get "
        "no loss (π_old recomputed by the trainer; needs old_logprobs: recompute or auto). None: off.",
    )
    tis_cap: float | None = Field(
        None,
        gt=0,
        description="Truncated importance sampling: weight each token's loss by min(π_old/π_rollout, tis_cap), "
        "π_old recomputed by the trainer (needs old_logprobs: recompute). None: off.",
    )
    staleness: Literal["none", "decay", "drop"] = Field(
        "none",
        description="Staleness-aware weighting of off-policy samples: decay multiplies a sample's loss by "
        "staleness_decay ** staleness; drop zeroes samples older than drop_older_than. "
        "(Which samples reach the trainer at all is schedule.max_staleness.)",
    )
    staleness_decay: float = Field(0.5, gt=0, le=1)
    drop_older_than: int = Field(
        1, ge=0, description="staleness: drop gives zero weight to samples more than this many versions old."
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for a user objective's constructor (built-ins take none)."
    )

    @field_validator("name")
    @classmethod
    def _known_or_dotted(cls, value: str) -> str:
        if value in ALGORITHMS:
            return value
        module, _, attr = value.partition(":") if ":" in value else value.rpartition(".")
        if not module or not attr.isidentifier():
            raise ValueError(
                f"unknown algorithm {value!r}: choose one of {', '.join(ALGORITHMS)}, or give a dotted path "
                "'package.module:Name' to your own objective"
            )
        return value

    @model_validator(mode="after")
    def _options_for_plugins(self) -> AlgorithmConfig:
        if self.options and self.name in ALGORITHMS:
            raise ValueError(
                f"options: the built-in algorithm {self.name} takes no options (got {sorted(self.options)})"
            )
        return self

    @model_validator(mode="after")
    def _corrections_need_recompute(self) -> AlgorithmConfig:
        if self.tis_cap is not None and self.old_logprobs == "rollout":
            raise ValueError("tis_cap needs the trainer's old-policy logprobs: old_logprobs recompute (or auto)")
        if self.mis_band is not None:
            low, high = self.mis_band
            if not 0 <= low < 1 < high:
                raise ValueError(f"mis_band: [{low}, {high}] must hold 1 with 0 ≤ low < 1 < high")
            if self.old_logprobs == "rollout":
                raise ValueError("mis_band needs the trainer's old-policy logprobs: old_logprobs recompute (or auto)")
        return self

    @property
    def corrects_rollout(self) -> bool:
        """True when a correction of the rollout's numerics (TIS or MIS) needs the trainer's old logprobs."""
        return self.tis_cap is not None or self.mis_band is not None
