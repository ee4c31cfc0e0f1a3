"""Rollout-stage throughput: Miles over SGLang vs raw SGLang, and SGLang vs the in-process `hf` engine.

Same prompts, same sampling (temperature 1, `ignore_eos`, fixed `max_new_tokens`, logprobs on), one
SGLang server. "raw" is one batched `/generate` call with every request, made directly with httpx;
"miles" is `RolloutManager.generate` over the `sglang` engine attached to that same server
(tokenization, routing in calls of `max_requests_per_call`, result parsing, rewards). Raw and Miles
rounds alternate so that both see the same machine state; medians are reported.

    python bench/rollout_throughput.py            # full run (~2 min here)
    python bench/rollout_throughput.py --quick    # smoke run (CI)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import build_model, machine, median, table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small batch, one round: checks that it runs")
    parser.add_argument("--out", type=Path, help="also write the report here (Markdown)")
    args = parser.parse_args()

    import httpx
    from transformers import AutoTokenizer

    from miles_rollout import RolloutManager, build_engine
    from miles_rollout.config import HFEngineConfig, RolloutConfig, SamplingConfig, SGLangEngineConfig
    from miles_rollout.engines.checkpoint import engine_dtype
    from miles_rollout.engines.sglang.server import SGLangServer
    from miles_rollout.tasks.arithmetic import arithmetic_prompts

    prompts_n, samples_n, max_new, rounds = (8, 4, 8, 1) if args.quick else (64, 8, 32, 5)
    cache = Path(os.environ.get("MILES_CACHE", Path.home() / ".cache" / "miles")) / "bench"
    model = build_model(cache / "qwen2-h256-l4", hidden=256, layers=4)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = arithmetic_prompts(prompts_n, seed=0)
    rollout = RolloutConfig(
        num_prompts_per_step=prompts_n,
        num_samples_per_prompt=samples_n,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=max_new, ignore_eos=True),
    )
    input_ids = [tokenizer.encode(p.prompt) for p in prompts for _ in range(samples_n)]
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": max_new, "ignore_eos": True}

    config = SGLangEngineConfig(type="sglang", max_total_tokens=65536)
    log_dir = Path(tempfile.mkdtemp(prefix="miles-bench-"))
    server = SGLangServer(model, config, engine_dtype(config.dtype, model), 0, log_dir)
    try:
        server.wait_ready(config.startup_timeout_s)
        client = httpx.Client(timeout=600)

        def raw() -> tuple[float, int]:
            start = time.perf_counter()
            body = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True}
            response = client.post(f"{server.url}/generate", json=body)
            response.raise_for_status()
            tokens = sum(len(out["output_ids"]) for out in response.json())
            return time.perf_counter() - start, tokens

        engine = build_engine(config.model_copy(update={"urls": [server.url]}), model)
        manager = RolloutManager(engine, tokenizer, rollout)

        def through(m: RolloutManager) -> tuple[float, int]:
            start = time.perf_counter()
            batch = asyncio.run(m.generate(prompts))
            return time.perf_counter() - start, sum(len(s.response_ids) for s in batch.samples)

        raw(), through(manager)  # warm-up: first calls compile and fill caches
        raw_tps, miles_tps = [], []
        for _ in range(rounds):
            seconds, tokens = raw()
            raw_tps.append(tokens / seconds)
            seconds, tokens = through(manager)
            miles_tps.append(tokens / seconds)
        engine.shutdown()
    finally:
        server.stop()

    hf_engine = build_engine(HFEngineConfig(), model)
    hf_manager = RolloutManager(hf_engine, tokenizer, rollout)
    through(hf_manager)
    hf_tps = []
    for _ in range(rounds):
        seconds, tokens = through(hf_manager)
        hf_tps.append(tokens / seconds)

    raw_m, miles_m, hf_m = median(raw_tps), median(miles_tps), median(hf_tps)
    report = "\n".join(
        [
            "# Rollout throughput",
            "",
            f"Machine: {machine()}. Model: random Qwen2, hidden 256, 4 layers, fp32. "
            f"Batch: {prompts_n} prompts x {samples_n} samples, {max_new} new tokens each (ignore_eos), "
            f"temperature 1, logprobs on. {rounds} alternating rounds, medians.",
            "",
            table(
                ["path", "tokens/s (median)", "rounds"],
                [
                    ["raw SGLang: one /generate call", raw_m, len(raw_tps)],
                    ["Miles: RolloutManager over the sglang engine", miles_m, len(miles_tps)],
                    ["Miles: RolloutManager over the in-process hf engine", hf_m, len(hf_tps)],
                ],
            ),
            "",
            f"Miles / raw SGLang: **{miles_m / raw_m:.3f}** (goal >= 0.9)",
            "",
            f"sglang engine / hf engine (both through Miles): **{miles_m / hf_m:.3f}**",
            "",
        ]
    )
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
