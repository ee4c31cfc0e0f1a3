"""A real pretrained model in bf16: what the trainer–engine mismatch and the engines' speed cost, side by side.

SmolLM2-135M-Instruct as it ships (tied embeddings, bf16 weights), real questions rendered with its chat
template, GRPO with lr 1e-4 (as the first report of the problem used), `--steps` steps per configuration,
engine and trainer (fsdp2, one rank) in one process (`miles_control.bench.inprocess`):

- **bf16 engines, trainer on its fp32 master weights**: how Miles ran before (`policy_weights: master`,
  `old_logprobs: rollout`): the engines hold the weights rounded to bf16, the trainer computes with weights
  they never see;
- **bf16 engines, trainer on the weights as pushed** (the default now): the trainer forwards with its master
  weights rounded as the push rounds them and recomputes the ratio's denominator under them;
- **fp32 engines** (`rollout.engine.dtype: float32`): nothing rounds.

Reported per configuration: mean |trainer − engine| logprob per token over the steps after the first push,
the clipped share of tokens, the share of each update that reaches the engines, and rollout tokens/s; the
ratio fp32 / bf16 of rollout speed is measured in the same run.

    python bench/real_model.py                   # SGLang engines, 3 steps of 8 prompts × 4 samples
    python bench/real_model.py --quick           # the hf engine, 2 steps of 2 prompts (CI)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, table  # noqa: E402

CONFIGS = {
    "bf16 engines, trainer on fp32 master weights (before)": (
        "bfloat16",
        {"policy_weights": "master", "algorithm": {"old_logprobs": "rollout"}},
    ),
    "bf16 engines, trainer on the weights as pushed (default)": ("bfloat16", {}),
    "fp32 engines": ("float32", {}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="hf engine, 2 steps of 2 prompts (CI)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", type=Path, help="also write the report here (Markdown)")
    args = parser.parse_args()
    steps = args.steps or (2 if args.quick else 3)
    num_prompts = 2 if args.quick else 8
    engine_type = "hf" if args.quick else "sglang"

    import torch
    from transformers import AutoTokenizer

    from miles_control.bench.inprocess import reset_engine, run_steps
    from miles_control.job.assets import build_packaged_model
    from miles_control.spec.config import PackagedModelConfig
    from miles_rollout import HFEngineConfig, build_engine
    from miles_rollout.config import SGLangEngineConfig
    from miles_rollout.data import load_prompts
    from miles_rollout.prompts import PromptEncoder

    torch.set_num_threads(2)
    model_dir = build_packaged_model(PackagedModelConfig(source="package"))
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(model_dir), "model")
    records = load_prompts(Path(__file__).resolve().parents[1] / "examples" / "capitals" / "capitals.jsonl")
    prompts = [encoder.encode(r) for r in records[:num_prompts]]
    train_base = {"backend": "fsdp2", "optimizer": {"lr": 1e-4}}
    work = Path(tempfile.mkdtemp(prefix="miles-real-model-"))
    results: dict[str, list[dict]] = {}
    engines: dict[str, object] = {}
    try:
        for name, (dtype, overrides) in CONFIGS.items():
            if dtype not in engines:
                for other in engines.values():  # one engine at a time: memory
                    other.shutdown()
                engines.clear()
                config = (
                    HFEngineConfig(dtype=dtype)
                    if engine_type == "hf"
                    else SGLangEngineConfig(type="sglang", dtype=dtype, max_total_tokens=16384, log_dir=str(work))
                )
                engines[dtype] = build_engine(config, model_dir, seed=0)
            engine = engines[dtype]
            reset_engine(engine, model_dir, dtype, work / "reset")
            train = {**train_base, **overrides}
            results[name] = run_steps(
                engine, model_dir, dtype, train, prompts, num_steps=steps, temperature=1.0, max_new_tokens=12
            )
            last = results[name][-1]
            print(f"{name}: logprob diff {last['train/logprob_diff']:.4f}", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()

    rows = []
    for name, per_step in results.items():
        assert all(s["weights_match"] for s in per_step), f"{name}: a push failed the weight check"
        later = per_step[1:] or per_step
        rows.append(
            [
                name,
                " / ".join(f"{s['train/logprob_diff']:.3f}" for s in per_step),
                sum(s["train/clipfrac"] for s in later) / len(later),
                " / ".join(
                    f"{s['train/update_kept_frac']:.3f}" if "train/update_kept_frac" in s else "1" for s in per_step
                ),
                sum(s["rollout_tokens_per_s"] for s in per_step) / len(per_step),
                sum(s["train_s"] for s in per_step) / len(per_step),
            ]
        )
    bf16_speed = rows[1][4]
    fp32_speed = rows[2][4]
    report = [
        f"# A real model in bf16: mismatch and speed ({engine_type} engine, fsdp2, {steps} steps)",
        "",
        f"Machine: {machine()}. SmolLM2-135M-Instruct (bf16, tied), {num_prompts} prompts × 4 samples per step,",
        "temperature 1.0, up to 12 new tokens, lr 1e-4. Step 1 is generated before any push.",
        "",
        table(
            [
                "configuration",
                "mean |Δ logprob| per step",
                "clipped tokens (steps ≥ 2)",
                "update reaching the engines per step",
                "rollout tokens/s",
                "train s/step",
            ],
            rows,
        ),
        "",
        f"Rollout speed fp32 engines / bf16 engines: **{fp32_speed / bf16_speed:.2f}** (same run, same prompts).",
        "",
    ]
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(report))
    print("\n".join(report))


if __name__ == "__main__":
    main()
