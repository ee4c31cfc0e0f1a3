"""miles_rollout: generation engines, the rollout manager, reward functions and prompt data.

Exports load lazily, so `miles_rollout.config` stays importable without torch.
"""

from miles_sync.lazy_exports import lazy_exports

_EXPORTS = {
    **dict.fromkeys(["DataConfig", "EvalConfig", "HFEngineConfig", "RolloutConfig", "SamplingConfig"], "config"),
    "build_engine": "engines",
    "RolloutManager": "manager",
    **dict.fromkeys(
        ["AbortsRequests", "LimitsCalls", "ReleasesMemory", "RolloutEngine", "TimesPushPhases", "WeightPushError"],
        "protocol",
    ),
    "register_reward": "rewards",
    "resolve_reward": "rewards",
    **dict.fromkeys(
        [
            "FinishReason",
            "GenerateRequest",
            "GenerateResult",
            "PromptRecord",
            "RolloutBatch",
            "Sample",
            "SampleStatus",
            "SamplingParams",
            "StageTiming",
        ],
        "types",
    ),
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
