"""LoRA against full fine-tuning on a real model: bytes per push, push time and the trainer–engine mismatch.

SmolLM2-135M-Instruct as it ships (bf16, tied embeddings), real questions rendered with its chat template, GRPO,
`--steps` steps per configuration, engine and trainer (fsdp2, one rank) in one process (`miles_control.bench.inprocess`):

- **full fine-tuning, hf engine**: every weight trains and every push carries the whole model;
- **LoRA, adapter push, hf engine** (`train.lora`, `sync.lora: adapter`): the adapter trains, a push carries its
  matrices alone, the engine applies them to the base it holds (PEFT);
- with SGLang (not `--quick`): **full fine-tuning**, **LoRA, adapter push** (each version loaded by name,
  generation never paused) and **LoRA, merged push** (`sync.lora: merge`: the merged weights, loaded and checked as
  a full push is).

Reported per configuration: bytes per push and their share of the full push, push seconds, mean |trainer − engine|
logprob per token per step (step 1 is generated before any push), and the adapter's share of the model's
parameters projected by its formula (rank × (in + out) per adapted linear) for larger models of the same families.

`--demo-steps N` adds the demo (examples/arithmetic.yaml, the built-in tiny model) trained N steps with full
fine-tuning and with LoRA, on the hf and the sglang engines (one job each, `miles_control.bench.sweep`): held-out
accuracy before and after, and wall time.

    python bench/lora.py                  # hf and SGLang engines, 3 steps of 8 prompts × 4 samples
    python bench/lora.py --demo-steps 60  # and the demo's learning, full against LoRA
    python bench/lora.py --demo-only --demo-seeds 4 --demo-engines hf  # the demo alone, four seeds per variant
    python bench/lora.py --demo-only --demo-seeds 3 --demo-engines hf --demo-no-full \
        --demo-lora '{"r 32": {"rank": 32, "alpha": 64}, "r 128": {"rank": 128, "alpha": 256}}'  # a rank sweep
    python bench/lora.py --quick          # the hf engine, 2 steps of 2 prompts (CI)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, table  # noqa: E402

LORA = {"rank": 8, "alpha": 16.0}  # every attention and MLP projection (train.lora's default targets)
# Larger models of the same families (config.json fields), for the projection.
SHAPES = {
    "Llama-3.1-8B": {"hidden": 4096, "layers": 32, "intermediate": 14336, "heads": 32, "kv_heads": 8, "params": 8.03e9},
    "Qwen2.5-32B": {"hidden": 5120, "layers": 64, "intermediate": 27648, "heads": 40, "kv_heads": 8, "params": 32.8e9},
}


def adapter_params(hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, rank: int) -> int:
    """LoRA parameters on q, k, v, o, gate, up and down of every layer: rank × (in + out) each."""
    kv = hidden // heads * kv_heads
    per_layer = (hidden + hidden) + (hidden + kv) * 2 + (hidden + hidden) + (hidden + intermediate) * 3
    return rank * per_layer * layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="hf engine, 2 steps of 2 prompts (CI)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", type=Path, help="also write the report here (Markdown)")
    parser.add_argument("--demo-steps", type=int, default=0, help="also train the demo this many steps, full vs LoRA")
    parser.add_argument("--demo-lr", type=float, default=1e-3, help="the demo's LoRA learning rate (full: the spec's)")
    parser.add_argument("--demo-seeds", type=int, default=1, help="runs per demo variant, seeds 0 … N-1")
    parser.add_argument("--demo-engines", default="hf,sglang", help="the demo's engines, comma-separated")
    parser.add_argument("--demo-only", action="store_true", help="the demo alone, without the SmolLM2 table")
    parser.add_argument(
        "--demo-lora",
        type=json.loads,
        default={"r 8": LORA},
        help="the demo's LoRA variants, a JSON mapping of name → train.lora (default: rank 8, alpha 16)",
    )
    parser.add_argument("--demo-no-full", action="store_true", help="the demo without its full fine-tuning runs")
    args = parser.parse_args()
    if args.demo_only:
        work = Path(tempfile.mkdtemp(prefix="miles-lora-demo-"))
        report = demo_learning(
            args.demo_steps or 60, args.demo_lr, work, args.demo_seeds, args.demo_engines.split(","), args.demo_lora,
            not args.demo_no_full,
        )  # fmt: skip
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text("\n".join(report))
        print("\n".join(report))
        return
    steps = args.steps or (2 if args.quick else 3)
    num_prompts = 2 if args.quick else 8

    import torch
    from transformers import AutoConfig, AutoTokenizer

    from miles_control.bench.inprocess import reset_engine, run_steps
    from miles_control.job.assets import build_packaged_model
    from miles_control.spec.config import PackagedModelConfig
    from miles_rollout import HFEngineConfig, build_engine
    from miles_rollout.config import SGLangEngineConfig
    from miles_rollout.data import load_prompts
    from miles_rollout.prompts import PromptEncoder
    from miles_train import TrainConfig

    torch.set_num_threads(2)
    model_dir = build_packaged_model(PackagedModelConfig(source="package"))
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(model_dir), "model")
    records = load_prompts(Path(__file__).resolve().parents[1] / "examples" / "capitals" / "capitals.jsonl")
    prompts = [encoder.encode(r) for r in records[:num_prompts]]
    peft_kwargs = TrainConfig.model_validate({"lora": LORA}).lora.peft_kwargs()  # type: ignore[union-attr]
    # (engine, train.lora, sync.lora, learning rate): an adapter learns at a larger rate than the whole model
    configs = {
        "full fine-tuning, hf engine": ("hf", False, "adapter", 1e-5),
        "LoRA r=8, adapter push, hf engine": ("hf", True, "adapter", 1e-4),
    }
    if not args.quick:
        configs |= {
            "full fine-tuning, sglang engine": ("sglang", False, "adapter", 1e-5),
            "LoRA r=8, adapter push, sglang engine": ("sglang", True, "adapter", 1e-4),
            "LoRA r=8, merged push, sglang engine": ("sglang", True, "merge", 1e-4),
        }
    work = Path(tempfile.mkdtemp(prefix="miles-lora-bench-"))
    results: dict[str, list[dict]] = {}
    for name, (engine_type, lora, push, lr) in configs.items():
        config = (
            HFEngineConfig()
            if engine_type == "hf"
            else SGLangEngineConfig(type="sglang", max_total_tokens=16384, log_dir=str(work))
        )
        adapter = peft_kwargs if lora and push == "adapter" else None
        engine = build_engine(config, model_dir, seed=0, lora=adapter)
        try:
            if adapter is None:  # an adapter engine holds the base as loaded: nothing to reset
                reset_engine(engine, model_dir, "bfloat16", work / "reset")
            train = {"backend": "fsdp2", "optimizer": {"lr": lr}, **({"lora": LORA} if lora else {})}
            results[name] = run_steps(
                engine, model_dir, "bfloat16", train, prompts, num_steps=steps, temperature=1.0, max_new_tokens=12,
                lora_push=push,
            )  # fmt: skip
        finally:
            engine.shutdown()
        print(f"{name}: {results[name][-1]['num_bytes'] / 1e6:.2f} MB per push", flush=True)

    full = {engine: r[0]["num_bytes"] for name, r in results.items() for engine in ("hf", "sglang")
            if name == f"full fine-tuning, {engine} engine"}  # fmt: skip
    rows = []
    for name, per_step in results.items():
        # None: unchecked (an adapter SGLang serves by name: its check reaches the folder its servers read)
        assert all(s["weights_match"] is not False for s in per_step), f"{name}: a push failed the weight check"
        engine_type = configs[name][0]
        sent = per_step[0]["num_bytes"]
        rows.append(
            [
                name,
                f"{sent / 1e6:.2f}",
                f"{sent / full[engine_type]:.4f}",
                sum(s["push_s"] for s in per_step) / len(per_step),
                " / ".join(f"{s['train/logprob_diff']:.3f}" for s in per_step),
                sum(s["train_s"] for s in per_step) / len(per_step),
            ]
        )
    hf_config = AutoConfig.from_pretrained(model_dir)
    shape = {
        "hidden": hf_config.hidden_size,
        "layers": hf_config.num_hidden_layers,
        "intermediate": hf_config.intermediate_size,
        "heads": hf_config.num_attention_heads,
        "kv_heads": hf_config.num_key_value_heads,
    }
    total = sum(p.numel() for p in _model(model_dir).parameters())
    projection = [["SmolLM2-135M (this run)", adapter_params(**shape, rank=LORA["rank"]) / total]]
    for model, s in SHAPES.items():
        params = s.pop("params")
        projection.append([f"{model} (formula)", adapter_params(**s, rank=LORA["rank"]) / params])
        s["params"] = params
    report = [
        f"# LoRA against full fine-tuning ({steps} steps, fsdp2, one rank)",
        "",
        f"Machine: {machine()}. SmolLM2-135M-Instruct (bf16, tied), {num_prompts} prompts × 4 samples per step, "
        "temperature 1.0, up to 12 new tokens; LoRA rank 8, alpha 16 on q/k/v/o/gate/up/down, lr 1e-4 (full: "
        "1e-5). Step 1 is generated before any push. Pushes in the engines' dtype (bf16).",
        "",
        table(
            [
                "configuration",
                "MB per push",
                "share of the full push",
                "push s",
                "mean |Δ logprob| per step",
                "train s/step",
            ],
            rows,
        ),
        "",
        "Adapter (rank 8 on the 7 projections) as a share of the model's parameters:",
        "",
        table(["model", "adapter / model parameters"], projection),
        "",
    ]
    if args.demo_steps:
        report += demo_learning(args.demo_steps, args.demo_lr, work, args.demo_seeds, args.demo_engines.split(","))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(report))
    print("\n".join(report))


def demo_learning(
    steps: int,
    lora_lr: float,
    work: Path,
    seeds: int = 1,
    engines: list[str] | None = None,
    loras: dict[str, dict] | None = None,
    full: bool = True,
) -> list[str]:
    """The demo trained `steps` steps, full against LoRA, on each engine and under each seed: one job per variant
    (`miles_control.bench.sweep`, one store). Held-out accuracy every 5 steps; a run's score is its gain over the start,
    read as the mean of its last three evaluations (one evaluation of 500 prompts varies by ~0.02 alone)."""
    import statistics

    from miles_control.bench.sweep import sweep
    from miles_control.spec.load import load_spec

    base = load_spec(
        Path(__file__).resolve().parents[1] / "examples" / "arithmetic.yaml",
        [f"schedule.num_steps={steps}", "rollout.eval.every_steps=5"],
    )
    kinds: dict[str, dict] = {"full": {}} if full else {}
    for name, lora in (loras or {"r 8": LORA}).items():
        kinds[f"LoRA {name}"] = {"train.lora": lora, "train.optimizer.lr": lora_lr}
    variants = {}
    for engine in engines or ["hf", "sglang"]:
        for kind, extra in kinds.items():
            for seed in range(seeds):
                variants[f"{kind}, {engine}, seed {seed}"] = {"rollout.engine": {"type": engine}, "seed": seed, **extra}
    runs = sweep(base, variants, work / "demo", on_run=lambda store, run: print(f"demo {run.name}: job {run.job_id}"))
    gains: dict[str, list[float]] = {}
    rows = []
    for run in runs:
        summary = run.summary
        if summary is None:
            rows.append([run.name, run.refused or "failed", "", "", "", ""])
            continue
        curve = dict(summary.eval_accuracy)
        first, last = curve.get(0, float("nan")), curve[max(curve)]
        tail = statistics.fmean(curve[k] for k in sorted(curve)[-3:])
        gains.setdefault(run.name.rsplit(", seed", 1)[0], []).append(tail - first)
        pushed = [s.total_s for s in summary.stages if s.stage == "weight_sync"]
        rows.append([run.name, f"{first:.3f}", f"{last:.3f}", f"{tail - first:+.3f}", summary.wall_s,
                     pushed[0] / max(len(summary.weight_sync_s), 1) if pushed else 0.0])  # fmt: skip
    spread = [
        [name, " / ".join(f"{g:+.3f}" for g in values), f"{statistics.fmean(values):+.3f}",
         f"{statistics.stdev(values):.3f}" if len(values) > 1 else ""]
        for name, values in gains.items()
    ]  # fmt: skip
    return [
        f"## The demo's learning, full fine-tuning against LoRA ({steps} steps)",
        "",
        f"examples/arithmetic.yaml (the built-in tiny Qwen2, 64 prompts × 8 samples per step, sync schedule), "
        f"{steps} steps; full fine-tuning at the spec's lr, LoRA ({json.dumps(loras or {'r 8': LORA})}; the 7 "
        f"projections unless named) at lr {lora_lr:g}. Held-out accuracy on 500 prompts every 5 steps; gain = mean of the last three evaluations "
        "less the first.",
        "",
        table(["run", "accuracy before", "at the last step", "gain", "wall s", "s per push"], rows),
        "",
        table(["variant", "gain by seed", "mean", "sd"], spread),
        "",
    ]


def _model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir))


if __name__ == "__main__":
    main()
