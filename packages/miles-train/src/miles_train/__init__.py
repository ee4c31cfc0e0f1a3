"""miles_train: trainer backends (FSDP2, Megatron-core, torchtitan), objectives (train.algorithm), supervised warm start, weight export.

Exports load lazily, so `miles_train.config` stays importable without torch.
"""

from miles_sync.lazy_exports import lazy_exports

_NAMES_BY_MODULE = {
    "config": [
        "AlgorithmConfig",
        "FSDP2Config",
        "MegatronConfig",
        "OptimizerConfig",
        "TorchtitanConfig",
        "TrainConfig",
    ],
    "objectives": ["AdvantageInputs", "LossInputs", "Objective", "build_objective"],
    "backends": ["build_backend"],
    "protocol": ["TrainerBackend"],
    "types": ["TrainBatch"],
    "loss": ["LossTerms", "aggregate", "kl_estimate", "ppo_clip"],
    "sft": ["supervised_finetune"],
}
_EXPORTS = {name: module for module, names in _NAMES_BY_MODULE.items() for name in names}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
