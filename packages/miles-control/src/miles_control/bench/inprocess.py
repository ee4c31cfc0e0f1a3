"""A job's loop in one process, without Ray: an engine and a trainer backend (one rank) joined by a sender.

generate → train → push (in the dtype the engines hold, as `sync.dtype: auto` sends) → weight check, a few
times. It exists to check a model on an engine × backend in seconds and to measure what a job would see
(the trainer–engine logprob difference, the share of each update that reaches the engines), with none of a
job's machinery around it: the architecture matrix (tests/model_matrix.py) and `bench/real_model.py` use it.
Jobs themselves run through `miles_control.job.runtime`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from miles_control.testing.servers import free_port


def checkpoint_weights(model_dir: Path) -> list:
    """The tensors of an HF checkpoint folder, as saved (a tied head is not among them)."""
    from safetensors.torch import load_file

    return [pair for f in sorted(Path(model_dir).glob("*.safetensors")) for pair in load_file(str(f)).items()]


def reset_engine(engine, model_dir: Path, engine_dtype: str, folder: Path) -> None:
    """Back to the checkpoint's weights (an earlier run left its own), checked as every push is."""
    from miles_rollout.push import land
    from miles_sync import DiskSync, build_sender

    sender = build_sender(DiskSync(dir=str(folder)).for_engines(engine_dtype))
    handle = sender.publish(checkpoint_weights(model_dir), weight_version=0)
    if not land(engine, handle).matches:
        raise RuntimeError("reset: the engine does not hold the checkpoint's weights")
    sender.close()


def run_steps(
    engine,
    model_dir: Path,
    engine_dtype: str,
    train: dict[str, Any],
    prompts: list,
    num_steps: int = 2,
    samples_per_prompt: int = 4,
    temperature: float = 0.8,
    max_new_tokens: int = 6,
    lora_push: str = "adapter",
) -> list[dict[str, Any]]:
    """`num_steps` GRPO steps of a fresh one-rank trainer (`train`: a TrainConfig mapping) against `engine`,
    which must hold the checkpoint's weights. One dict per step: the trainer's metrics, whether the engine's
    weights matched the push, what was sent, and timings. The reward is a fixed function of the response's
    token ids (groups get different rewards, so advantages are not zero). With `train.lora`, `lora_push` is
    sync.lora (an `adapter` push needs an engine built with the adapter's config). A prompt is its ids, or (ids,
    multimodal inputs) for a prompt with images (`PromptEncoder.inputs`)."""
    from miles_rollout import GenerateRequest, SamplingParams
    from miles_rollout.push import land
    from miles_sync import TensorSync, build_sender
    from miles_train import TrainConfig, build_backend
    from miles_train.types import TrainBatch

    sync = TensorSync().for_engines(engine_dtype)  # what a job's runtime resolves (sync.dtype: auto)
    backend = build_backend(TrainConfig.model_validate(train), model_dir, 0, 1, f"tcp://127.0.0.1:{free_port()}")
    backend.set_push_dtype(sync.pushed_precision(engine_dtype))
    backend.set_lora_push(lora_push)
    sender = build_sender(sync)
    sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
    steps = []
    try:
        for step in range(1, num_steps + 1):
            pairs = [
                p if isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], dict) else (p, None) for p in prompts
            ]
            requests = [
                GenerateRequest(ids, sampling, request_id=f"{g}-{k}", multimodal=multimodal)
                for g, (ids, multimodal) in enumerate(pairs)
                for k in range(samples_per_prompt)
            ]
            started = time.time()
            results = asyncio.run(engine.generate(requests))
            generated = time.time()
            batch = TrainBatch(
                input_ids=[r.input_ids + out.output_ids for r, out in zip(requests, results, strict=True)],
                response_start=[len(r.input_ids) for r in requests],
                rollout_logprobs=[out.output_logprobs for out in results],
                loss_mask=[[1] * len(out.output_ids) for out in results],
                rewards=[float(sum(out.output_ids) % 3 == 0) for out in results],
                group_index=[int(r.request_id.split("-")[0]) for r in requests],
                temperature=temperature,
                routed_experts=[out.routed_experts for out in results]
                if results[0].routed_experts is not None
                else None,
                multimodal=[r.multimodal for r in requests] if any(r.multimodal for r in requests) else None,
            )
            metrics = backend.train_step(batch)
            trained = time.time()
            handle = sender.publish(backend.export_weights(), weight_version=step)
            landed = land(engine, handle)
            steps.append(
                {
                    "weights_match": landed.weights_match,  # None: of a copy the engine keeps (unmeasured)
                    "num_tensors": handle.num_tensors,
                    "num_bytes": handle.num_bytes,
                    "dtype": handle.dtype,
                    "rollout_tokens_per_s": sum(len(o.output_ids) for o in results) / max(generated - started, 1e-9),
                    "train_s": trained - generated,
                    "push_s": time.time() - trained,
                    **{k: v for k, v in metrics.items() if k.startswith("train/")},
                }
            )
    finally:
        sender.close()
        backend.shutdown()
    return steps
