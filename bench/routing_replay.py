"""Rollout routing replay on a mixture of experts: routing agreement and the trainer–engine logprob difference,
with the trainer's own routing and with the engine's replayed (`train.routing_replay`).

A tiny random Qwen3-MoE or Mixtral (tests/model_matrix.py's: 4 experts, top 2, 2 layers, the arithmetic character
vocabulary) in each dtype, served by one SGLang server that returns its routing (`rollout.engine.routed_experts`), trained by
each of `--backends` (fsdp2: transformers' MoE modules; megatron: megatron-core's MoE layer; torchtitan: its MoE)
on one rank in this
process (`miles_control.bench.inprocess.run_steps`): `--steps` GRPO steps with replay off, the engine reset to the
checkpoint, then the same with replay on. Reported per step: `train/routing_agreement` (the
share of position × layer pairs whose top-k the trainer and the engine agree on), and the mean and p99 of
|trainer − engine| logprob per token.

    python bench/routing_replay.py            # bf16 and fp32, 4 steps each
    python bench/routing_replay.py --families mixtral --dtypes bfloat16 --steps 2 --backends megatron
    python bench/routing_replay.py --experts 16 --top-k 4 --router-scale 0.02 --dtypes bfloat16 --backends fsdp2
    python bench/routing_replay.py --quick    # one step each way, one cell (tests/test_bench.py)

`--experts`, `--top-k` and `--router-scale` reshape the tiny model: more experts, and router weights scaled down so
that the experts' scores lie close together (near-ties that bf16 arithmetic breaks differently in the engine and
the trainer), the regime where routing replay has something to correct.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import machine, table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated checkpoint dtypes")
    parser.add_argument("--families", default="qwen3_moe", help="comma-separated: qwen3_moe, mixtral")
    parser.add_argument(
        "--backends", default="fsdp2,megatron,torchtitan", help="comma-separated: fsdp2, megatron, torchtitan"
    )
    parser.add_argument("--experts", type=int, default=None, help="experts per layer (default: the tiny model's 4)")
    parser.add_argument("--top-k", type=int, default=None, help="experts per token (default: 2)")
    parser.add_argument("--router-scale", type=float, default=1.0, help="multiplies every router's weights")
    parser.add_argument("--out", type=Path, help="also write the report here (Markdown)")
    parser.add_argument(
        "--quick", action="store_true", help="one step each way: Mixtral in bf16 on fsdp2, 8 experts, routers × 0.05"
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.families, args.dtypes, args.backends = 1, "mixtral", "bfloat16", "fsdp2"
        args.experts, args.router_scale = 8, 0.05

    from model_matrix import TOY_PROMPTS

    from miles_control.bench.inprocess import reset_engine, run_steps
    from miles_rollout import build_engine
    from miles_rollout.config import SGLangEngineConfig

    work = Path(tempfile.mkdtemp(prefix="miles-routing-"))
    rows = []
    for family, dtype in [(f, d) for f in args.families.split(",") for d in args.dtypes.split(",")]:
        model = _model(family, dtype, work / f"{family}-{dtype}", args.experts, args.top_k, args.router_scale)
        config = SGLangEngineConfig(
            type="sglang", max_total_tokens=4096, log_dir=str(work / "logs"), routed_experts=True
        )
        engine = build_engine(config, model, seed=0)
        try:
            for backend in args.backends.split(","):
                for replay in (False, True):
                    reset_engine(engine, model, dtype, work / "reset")
                    train = {"backend": backend, "optimizer": {"lr": 1e-3}, "routing_replay": replay}
                    steps = run_steps(engine, model, dtype, train, TOY_PROMPTS * 4, num_steps=args.steps)
                    for step, metrics in enumerate(steps, start=1):
                        assert metrics["weights_match"], f"{dtype} step {step}: the engine holds other weights"
                        rows.append([
                            family, dtype, backend, "on" if replay else "off", step,
                            f"{metrics['train/routing_agreement']:.4f}", f"{metrics['train/logprob_diff']:.2e}",
                            f"{metrics['train/logprob_diff_p99']:.2e}",
                        ])  # fmt: skip
        finally:
            engine.shutdown()
    report = [
        "# Routing replay",
        "",
        machine(),
        "",
        f"Tiny mixtures of experts ({args.experts or 4} experts, top {args.top_k or 2}, 2 layers, router weights × "
        f"{args.router_scale:g}), SGLang on this machine, each backend on one rank, 16 prompts × 4 "
        f"samples per step, {args.steps} steps with replay off, then on (the engine reset to the checkpoint).",
        "",
        table(
            [
                "family",
                "dtype",
                "backend",
                "replay",
                "step",
                "routing agreement",
                "mean |Δ logprob|",
                "p99 |Δ logprob|",
            ],
            rows,
        ),
        "",
    ]
    if args.out is not None:
        args.out.write_text("\n".join(report))
    print("\n".join(report))


def _model(family: str, dtype: str, folder: Path, experts: int | None, top_k: int | None, router_scale: float) -> Path:
    """tests/model_matrix.py's tiny model of `family`, with `experts` per layer, `top_k` per token and its routers'
    weights multiplied by `router_scale`."""
    from model_matrix import build_model
    from safetensors.torch import load_file, save_file

    shape = {"num_local_experts": experts} if experts else {}
    shape |= {"num_experts_per_tok": top_k} if top_k else {}
    model = build_model(family, dtype, folder, **shape)
    if router_scale != 1.0:
        path = model / "model.safetensors"
        tensors = load_file(str(path))
        for name in tensors:
            if name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
                tensors[name] = tensors[name] * router_scale
        save_file(tensors, str(path), metadata={"format": "pt"})
    return model


if __name__ == "__main__":
    main()
