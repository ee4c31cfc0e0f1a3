"""The architecture matrix, run as one process (tests/test_model_matrix.py starts it and reads its results).

usage: python model_matrix.py OUT_JSON WORKDIR [ENGINE[:FAMILY/DTYPE,...] ...]   (an engine alone: every cell)
       python model_matrix.py OUT_JSON WORKDIR --smollm2   (the real model, as shipped: tied, bf16)

Tiny random-weight models built from the configs of the families users bring, saved in fp32 and in bf16,
each served by every engine and trained by every backend on one rank, two GRPO steps each: generate →
train → push (the engines' dtype, as `sync.dtype: auto` sends) → weight check. A combination a backend or
engine does not support must be refused by the validation a job runs first (`check_model`), naming the
config.json field. Trainers run in this process one after another; megatron's and torchtitan's CPU
adjustments patch the process, which is why the matrix is not run inside the pytest process.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

# The families users bring, as miles_control.testing.tiny_models shapes them (vocabulary: the arithmetic character
# tokenizer's, since SGLang needs a tokenizer in the folder); megatron and torchtitan refuse llama3.2's RoPE scaling
# and the layers that differ from Llama's (Phi-3's fused checkpoint projections, OLMo-2's norms). The mixtures of
# experts run on every backend (the matrix on one rank; tests/test_routing_replay.py runs megatron with its experts
# over two).
FAMILIES = (
    "qwen2.5", "llama3", "llama3.2", "qwen3", "mistral", "phi3", "olmo2", "qwen3_moe", "mixtral", "gemma3_text",
    "olmoe", "qwen2_moe", "deepseek_v3", "qwen2_5_vl", "qwen3_vl",
)  # fmt: skip
# vision-language families (miles_control.testing.tiny_models.VISION_FAMILIES): their prompts carry an image each,
# the trainer's forward takes the engine's pixel inputs, and a push carries the vision tower
VISION = ("qwen2_5_vl", "qwen3_vl")
# What the rebuilt models of megatron and torchtitan do not cover, and the config.json field their refusal names
# (everything else is expected to run).
REBUILT = ("megatron", "torchtitan")
REFUSED = {
    ("llama3.2", "megatron"): "rope_parameters.rope_type: 'llama3'",
    ("llama3.2", "torchtitan"): "rope_parameters.rope_type: 'llama3'",
    ("phi3", "megatron"): "model_type: 'phi3'",
    ("phi3", "torchtitan"): "model_type: 'phi3'",
    ("olmo2", "megatron"): "model_type: 'olmo2'",
    ("olmo2", "torchtitan"): "model_type: 'olmo2'",
    **{(f, b): f"model_type: '{f}'" for f in ("gemma3_text", "olmoe", "qwen2_moe", "deepseek_v3") for b in REBUILT},
    **{(f, b): f"model_type '{f}' is a vision-language model" for f in VISION for b in REBUILT},
}
# What SGLang's CPU path cannot serve (miles_rollout.engines.SGLANG_CPU_REFUSED), refused before its servers start
ENGINE_REFUSED = {
    ("qwen2_moe", "sglang"): "model_type: 'qwen2_moe'",
    ("deepseek_v3", "sglang"): "model_type: 'deepseek_v3'",
    **{(f, "sglang"): f"model_type: '{f}' is a vision-language model" for f in VISION},  # Miles sends it no images
}
# The table docs/real-models.md shows, one row per family: what sets it apart
TITLES = {
    "qwen2.5": "Qwen2 / Qwen2.5 (q/k/v biases, tied head)",
    "llama3": "Llama 3 (untied head)",
    "llama3.2": "Llama 3.2 (tied head, `llama3` RoPE scaling)",
    "qwen3": "Qwen3 (per-head q/k RMSNorm, wide `head_dim`)",
    "mistral": "Mistral v0.3 (Llama's layer, `sliding_window: null`)",
    "phi3": "Phi-3 (`qkv_proj` and `gate_up_proj` fused in the checkpoint)",
    "olmo2": "OLMo-2 (norms after attention and MLP, q/k RMSNorm over all heads)",
    "qwen3_moe": "Qwen3-MoE (every MLP a mixture of experts, top-k routing)",
    "mixtral": "Mixtral (Llama's attention, `block_sparse_moe` experts w1/w3/w2)",
    "gemma3_text": "Gemma 3 text (sandwich norms, q/k norms, scaled embeddings, sliding-window layers, tied head)",
    "olmoe": "OLMoE (q/k norms, every MLP a mixture of experts, top-k without renormalising)",
    "qwen2_moe": "Qwen2-MoE (routed experts beside a gated shared expert)",
    "deepseek_v3": "DeepSeek-V3 (latent attention, dense first layer, sigmoid-scored experts, shared expert)",
    "qwen2_5_vl": "Qwen2.5-VL (windowed-attention vision tower, 3-D RoPE; an image in every prompt)",
    "qwen3_vl": "Qwen3-VL (vision tower feeding early layers (deepstack), interleaved 3-D RoPE; an image per prompt)",
}
DTYPES = ("float32", "bfloat16")
BACKENDS = ("fsdp2", "megatron", "torchtitan")
ENGINES = ("hf", "sglang")
STEPS = 2


def table() -> str:
    """The family × backend × engine table of docs/real-models.md, as this matrix runs it (test_model_matrix checks
    that the page shows it): every cell runs two steps on both engines in fp32 and bf16, or is refused."""
    lines = [
        "| family (config) | `hf` / `sglang` engine | " + " | ".join(f"`{b}`" for b in BACKENDS) + " |",
        "|---|---|" + "---|" * len(BACKENDS),
    ]
    for family in FAMILIES:
        cells, first = [], None
        for backend in BACKENDS:
            refused = REFUSED.get((family, backend))
            if refused is None:
                cells.append("yes")
            elif refused == first:
                cells.append("refused: same")
            else:
                cells.append(f"refused: `{refused}`")
                first = refused
        engines = (
            f"`hf` (`sglang` refused: `{ENGINE_REFUSED[family, 'sglang']}`)"
            if (family, "sglang") in ENGINE_REFUSED
            else "both"
        )
        lines.append(f"| {TITLES[family]} | {engines} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_model(family: str, dtype: str, folder: Path, **overrides: Any) -> Path:
    """A tiny random-weight model of `family` with the arithmetic character tokenizer (a vision-language family: its
    processor's), saved in `dtype`; `overrides` are config fields (e.g. `num_local_experts`)."""
    from miles_control.testing.tiny_models import save_tiny_model, save_tiny_vision_model, tiny_model

    if family in VISION:
        return save_tiny_vision_model(folder, family, seed=sum(map(ord, family)), dtype=dtype)
    from miles_rollout.tasks.arithmetic import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = tiny_model(family, tokenizer=tokenizer, max_position_embeddings=256, **overrides)
    return save_tiny_model(folder, config, tokenizer=tokenizer, seed=sum(map(ord, family)), dtype=dtype)


TOY_PROMPTS = [[3 + (i % 10), 13, 4 + (i % 7), 16] for i in range(4)]  # "a+b=" in the character vocabulary


def run_combination(
    engine, model_dir: Path, engine_dtype: str, backend_type: str, workdir: Path, prompts=TOY_PROMPTS, lr=1e-3
) -> dict:
    """Refused by the check a job runs first, or two steps from the checkpoint's weights."""
    from transformers import AutoConfig

    from miles_control.bench.inprocess import reset_engine, run_steps
    from miles_train import TrainConfig
    from miles_train.backends import check_model

    train = {"backend": backend_type, "optimizer": {"lr": lr}}
    try:
        check_model(TrainConfig.model_validate(train).backend, AutoConfig.from_pretrained(model_dir))
    except ValueError as exc:
        return {"refused": str(exc)}
    reset_engine(engine, model_dir, engine_dtype, workdir / "reset")
    return {"steps": run_steps(engine, model_dir, engine_dtype, train, prompts, num_steps=STEPS)}


def engine_config(engine_name: str, log_dir: Path):
    """`hf` or `sglang` in the checkpoint's dtype; with `-fp32` (e.g. `hf-fp32`), in fp32 whatever the checkpoint's."""
    from miles_rollout import HFEngineConfig
    from miles_rollout.config import SGLangEngineConfig

    dtype = "float32" if engine_name.endswith("-fp32") else "auto"
    if engine_name.startswith("hf"):
        return HFEngineConfig(dtype=dtype)
    return SGLangEngineConfig(type="sglang", dtype=dtype, max_total_tokens=4096, log_dir=str(log_dir))


def run_plan(plan: list[tuple], workdir: Path, results: dict) -> None:
    """Each (model folder, engine, backends, key, options) in turn: one engine, every backend against it, into
    results[key/backend]. The next engine starts while the current one is used, and a used one stops in the
    background (an SGLang server takes ~20 s to come up and up to ~10 s to go: both overlap with the work)."""
    from concurrent.futures import ThreadPoolExecutor

    from miles_rollout import build_engine
    from miles_rollout.engines.checkpoint import engine_dtype

    def start(item):
        model_dir, engine_name, _, key, _ = item
        return build_engine(engine_config(engine_name, workdir / "logs" / key), model_dir, seed=0)

    def ahead(item):
        # Only an SGLang engine starts ahead (a server process). An hf engine loads its model with transformers in
        # this process, and a load on a thread while the trainer loads its own model races in transformers'
        # process-wide loading state: a tied head came out untied (lm_head missing from a push). It takes < 1 s.
        return starter.submit(start, item) if item[1].startswith("sglang") else None

    with ThreadPoolExecutor(max_workers=1) as starter, ThreadPoolExecutor(max_workers=2) as stopper:
        pending = ahead(plan[0])
        for index, (model_dir, engine_name, backends, key, options) in enumerate(plan):
            started = time.time()
            try:
                engine = pending.result() if pending is not None else start(plan[index])
            except Exception:  # noqa: BLE001 - reported per combination
                engine = None
                for backend_type in backends:
                    results[f"{key}/{backend_type}"] = {"error": traceback.format_exc()[-3000:]}
            pending = ahead(plan[index + 1]) if index + 1 < len(plan) else None
            if engine is None:
                continue
            try:
                held = engine_dtype(engine_config(engine_name, workdir).dtype, model_dir)
                tensors = checkpoint_tensors(model_dir)
                for backend_type in backends:
                    try:
                        result = run_combination(engine, model_dir, held, backend_type, workdir / key, **options)
                    except Exception:  # noqa: BLE001 - reported per combination
                        result = {"error": traceback.format_exc()[-3000:]}
                    results[f"{key}/{backend_type}"] = {"engine_dtype": held, "checkpoint_tensors": tensors, **result}
            finally:
                stopper.submit(engine.shutdown)
            print(f"{key}: {time.time() - started:.1f} s", flush=True)


def checkpoint_tensors(model_dir: Path) -> int:
    """Tensors of the checkpoint as a push carries them (a tied head once: as the embedding)."""
    from safetensors import safe_open

    from miles_rollout.engines.checkpoint import tied_embeddings

    names: set[str] = set()
    for file in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            names |= set(handle.keys())
    return len(names - ({"lm_head.weight"} if tied_embeddings(model_dir) else set()))


def engine_refusal(engine: str, model_dir: Path) -> str | None:
    """What the check a job runs first says of serving this model on `engine` (None: it serves it)."""
    from transformers import AutoConfig

    from miles_rollout.engines import check_model

    try:
        check_model(engine_config(engine, model_dir), AutoConfig.from_pretrained(model_dir))
    except ValueError as exc:
        return str(exc)
    return None


def vision_prompts(model_dir: Path, num: int = 4) -> list[tuple[list[int], dict]]:
    """Prompts with an image each (the counting task's), as the model's processor renders them."""
    from miles_rollout.prompts import load_encoder
    from miles_rollout.tasks.counting import QUESTION, counting_rows
    from miles_rollout.types import PromptRecord

    encoder = load_encoder(model_dir, "model")
    return [encoder.inputs(PromptRecord(QUESTION, label, images=[image])) for image, label in counting_rows(num, 0)]


def capitals_prompts(model_dir: Path, num: int = 2) -> list[list[int]]:
    from transformers import AutoTokenizer

    from miles_rollout.data import load_prompts
    from miles_rollout.prompts import PromptEncoder

    records = load_prompts(Path(__file__).parents[1] / "examples" / "capitals" / "capitals.jsonl")[:num]
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(model_dir), "model")
    return [encoder.encode(r) for r in records]


def main() -> None:
    out, workdir = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(2)
    results: dict[str, dict] = {}
    if sys.argv[3:] == ["--smollm2"]:
        from miles_control.job.assets import build_packaged_model
        from miles_control.spec.config import PackagedModelConfig

        model_dir = build_packaged_model(PackagedModelConfig(source="package"))
        # Real questions, rendered with the model's chat template; a learning rate for a pretrained model.
        options = {"prompts": capitals_prompts(model_dir), "lr": 1e-5}
        plan = [
            (model_dir, "hf", ["fsdp2"], "smollm2/hf", options),
            (model_dir, "sglang", BACKENDS, "smollm2/sglang", options),
            (model_dir, "hf-fp32", ["fsdp2"], "smollm2/hf-fp32", options),  # fp32 engines: nothing rounds
        ]
    else:
        plan = []
        for arg in sys.argv[3:] or ENGINES:
            engine, colon, cells = arg.partition(":")
            if colon and not cells:
                sys.exit(f"{arg}: no cells named after the colon (FAMILY/DTYPE,...)")
            wanted = cells.split(",") if cells else [f"{f}/{d}" for f in FAMILIES for d in DTYPES]
            for cell in wanted:
                family, dtype = cell.split("/")
                model_dir = build_model(family, dtype, workdir / f"{family}-{dtype}")
                refused = engine_refusal(engine, model_dir)
                if refused is not None:  # before any server starts, as a job's check does
                    results |= {f"{cell}/{engine}/{b}": {"refused": refused} for b in BACKENDS}
                    continue
                options = {"prompts": vision_prompts(model_dir)} if family in VISION else {}
                plan.append((model_dir, engine, BACKENDS, f"{cell}/{engine}", options))
    if plan:
        run_plan(plan, workdir, results)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
