"""miles_train: trainer backends (FSDP2, Megatron-core, torchtitan), objectives (train.algorithm), supervised warm start, weight export.

Exports load lazily, so `miles_train.config` stays importable without torch.
"""

from miles_sync.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(
        [
            "AlgorithmConfig",
            "FSDP2Config",
            "MegatronConfig",
            "OptimizerConfig",
            "TorchtitanConfig",
            "TrainConfig",
        ],
        "config",
    ),
    **dict.fromkeys(["AdvantageInputs", "LossInputs", "Objective", "build_objective"], "objectives"),
    "build_backend": "backends",
    "TrainerBackend": "protocol",
    "TrainBatch": "types",
    **dict.fromkeys(["LossTerms", "aggregate", "kl_estimate", "ppo_clip"], "loss"),
    "supervised_finetune": "sft",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
