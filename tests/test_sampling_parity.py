"""Sampling parameters travel with the data: the batch a rollout makes says how it was sampled, and the
trainer recomputes logprobs at that temperature (`SamplingParams.logprob_temperature`: the sampling
temperature, or 1 when greedy). Through the real path: RolloutManager → RolloutBatch → to_train_batch →
a trainer backend's `compute_logprobs`, on the hf engine and on SGLang, both in fp32, at temperature 0.7
(sampled) and 0 (greedy)."""

import asyncio
import dataclasses
import importlib.util

import pytest

ENGINES = [
    "hf",
    pytest.param(
        "sglang",
        marks=[
            pytest.mark.slow,
            pytest.mark.sglang,
            pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed"),
        ],
    ),
]


@pytest.mark.parametrize("engine_type", ENGINES)
def test_trainer_recomputes_logprobs_at_the_temperature_the_engine_sampled(engine_type, tmp_path):
    import torch
    from transformers import AutoTokenizer

    from miles_control.job.assets import build_builtin_model
    from miles_control.job.convert import to_train_batch
    from miles_control.spec.config import BuiltinModelConfig
    from miles_control.testing.servers import free_port
    from miles_rollout import RolloutManager, build_engine
    from miles_rollout.config import HFEngineConfig, RolloutConfig, SGLangEngineConfig
    from miles_rollout.tasks.arithmetic import arithmetic_prompts
    from miles_train import TrainConfig, build_backend

    model_dir = build_builtin_model(BuiltinModelConfig())
    if engine_type == "hf":
        engine_config = HFEngineConfig(dtype="float32")
    else:
        engine_config = SGLangEngineConfig(type="sglang", dtype="float32", log_dir=str(tmp_path))
    config = RolloutConfig.model_validate(
        {"engine": engine_config.model_dump(), "num_samples_per_prompt": 2, "sampling": {"temperature": 0.7}}
    )
    prompts = arithmetic_prompts(8, seed=3)
    engine = build_engine(engine_config, model_dir)
    trainer = build_backend(TrainConfig(), model_dir, 0, 1, f"tcp://127.0.0.1:{free_port()}")
    try:
        manager = RolloutManager(engine, AutoTokenizer.from_pretrained(model_dir), config)
        for temperature in (0.7, 0.0):
            batch = asyncio.run(manager.generate(prompts, temperature=None if temperature == 0.7 else 0.0))
            assert batch.sampling is not None and batch.sampling.temperature == temperature
            train_batch = to_train_batch(batch)
            assert train_batch.temperature == (0.7 if temperature else 1.0)  # greedy: the model's distribution
            recomputed = trainer.compute_logprobs(train_batch)
            engine_lp = torch.tensor([lp for row in train_batch.rollout_logprobs for lp in row])
            trainer_lp = torch.tensor([lp for row in recomputed for lp in row])
            diff = (engine_lp - trainer_lp).abs().mean().item()
            print(f"{engine_type} T={temperature}: mean |trainer - engine| {diff:.2e}")
            assert diff <= 1e-5, (temperature, diff)
            if temperature:  # the test has teeth: at another temperature the two would disagree
                wrong = dataclasses.replace(train_batch, temperature=1.0)
                off = torch.tensor([lp for row in trainer.compute_logprobs(wrong) for lp in row])
                assert (engine_lp - off).abs().mean().item() > 1e-2
    finally:
        trainer.shutdown()
        engine.shutdown()
