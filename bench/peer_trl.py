"""Miles against a peer: Hugging Face TRL's `GRPOTrainer` on the demo's task, same model, prompts and settings.

Both learn the demo's arithmetic task (`examples/arithmetic.yaml`) from the same warm-started tiny Qwen2 (the
builtin model), on the same training prompts in the same order (no shuffling), 64 prompts × 8 samples a step,
temperature 1, 6 new tokens, exact-match reward, GRPO with the group's std normalisation, clip 0.2, no KL, the
token-mean loss (TRL's `dapo`), lr 1e-4 constant, no gradient clipping, fp32, no gradient checkpointing. Both
evaluate greedy held-out accuracy on the same 500 prompts every 10 steps and stop at the target (0.9).

The runs alternate (TRL, Miles on the `hf` engine, and with `--engines hf sglang` Miles on SGLang, then again with
`--repeats`), each in its own process. Reported per run: steps and seconds to the target (evaluation time left out
of both), the mean step split into generation, training and the rest, and the ratios to TRL's run of the same round.
TRL is an optional bench dependency, pinned in requirements/dev.txt (trl 1.16.0).

    .venv/bin/python bench/peer_trl.py                      # hf engine, once
    .venv/bin/python bench/peer_trl.py --engines hf sglang --repeats 3 --out peer.md
    .venv/bin/python bench/peer_trl.py --quick              # a smoke run (tests/test_bench.py); numbers mean nothing
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from common import table  # noqa: E402

FULL = {"prompts": 64, "samples": 8, "eval_prompts": 500, "eval_every": 10, "max_steps": 600, "target": 0.9}
QUICK = {"prompts": 4, "samples": 4, "eval_prompts": 20, "eval_every": 2, "max_steps": 2, "target": 1.01}
NUM_TRAIN, SEED = 20000, 0


def model_folder() -> Path:
    """The demo's warm-started tiny Qwen2 (cached after the first build)."""
    from miles_control.job.assets import build_builtin_model
    from miles_control.spec.config import BuiltinModelConfig

    return Path(build_builtin_model(BuiltinModelConfig(warm_start_target=0.35)))


def prompts(num_eval: int):
    from miles_rollout.tasks.arithmetic import split_train_eval

    return split_train_eval(NUM_TRAIN, num_eval, SEED, 2, ["+"])


# ---- TRL, in a child process ---------------------------------------------------------------------------------
def run_trl(model_dir: Path, size: dict, out: Path) -> None:
    """One TRL run; writes {steps: [{step, seconds, generate_s}], evals: [{step, accuracy, seconds}]} to `out`."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(SEED)
    train, held_out = prompts(size["eval_prompts"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = Dataset.from_list([{"prompt": r.prompt, "label": r.label} for r in train])

    def exact_match(completions, label, **_):
        return [float(c.strip() == y.strip()) for c, y in zip(completions, label, strict=True)]

    record: dict = {"steps": [], "evals": []}

    @torch.no_grad()
    def accuracy() -> float:
        model.eval()
        right = 0
        for first in range(0, len(held_out), 250):
            part = held_out[first : first + 250]
            batch = tokenizer([r.prompt for r in part], return_tensors="pt", padding=True, add_special_tokens=False)
            out_ids = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(out_ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
            right += sum(t.strip() == r.label.strip() for t, r in zip(texts, part, strict=True))
        model.train()
        return right / len(held_out)

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.began = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            record["steps"].append({"step": state.global_step, "seconds": time.perf_counter() - self.began})
            if state.global_step % size["eval_every"] == 0:
                start = time.perf_counter()
                value = accuracy()
                record["evals"].append({"step": state.global_step, "accuracy": value,
                                        "seconds": time.perf_counter() - start})  # fmt: skip
                if value >= size["target"]:
                    control.should_training_stop = True

    per_step = size["prompts"] * size["samples"]
    config = GRPOConfig(
        output_dir=str(out.parent / "trl-out"), per_device_train_batch_size=per_step, gradient_accumulation_steps=1,
        num_generations=size["samples"], max_completion_length=6, temperature=1.0, top_p=1.0,
        learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
        loss_type="dapo", beta=0.0, epsilon=0.2, scale_rewards="group", num_iterations=1,
        bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, shuffle_dataset=False,
        max_steps=size["max_steps"], logging_steps=1, report_to="none", save_strategy="no", seed=SEED,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Clock()])  # fmt: skip
    generate = trainer._generate_and_score_completions  # timed: the generation (and scoring) part of a step

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            record.setdefault("generate", []).append(time.perf_counter() - start)

    trainer._generate_and_score_completions = timed_generate
    record["evals"].append({"step": 0, "accuracy": accuracy(), "seconds": 0.0})
    trainer.train()
    for step, seconds in zip(record["steps"], record.get("generate", []), strict=False):
        step["generate_s"] = seconds
    out.write_text(json.dumps(record))


# ---- Miles, through `miles run` --------------------------------------------------------------------------------
def run_miles(engine: str, size: dict, work: Path) -> dict:
    """One Miles run of examples/arithmetic.yaml with the bench's sizes; its steps, stage seconds and evals."""
    from miles_control.service.store import Store

    store = f"sqlite:///{work}/miles.db"
    sets = [
        f"rollout.engine.type={engine}", f"rollout.num_prompts_per_step={size['prompts']}",
        f"rollout.num_samples_per_prompt={size['samples']}", f"rollout.eval.every_steps={size['eval_every']}",
        f"rollout.eval.num_prompts={size['eval_prompts']}", f"data.num_eval={size['eval_prompts']}",
        f"schedule.num_steps={size['max_steps']}", f"schedule.stop_at_accuracy={min(size['target'], 1.0)}",
        "schedule.max_minutes=60", f"store.url={store}", f"output_dir={work}/out", "train.backend.type=fsdp2",
    ]  # fmt: skip
    command = [str(Path(sys.executable).parent / "miles"), "run", str(ROOT / "examples" / "arithmetic.yaml"),
               "--quiet"] + [arg for s in sets for arg in ("--set", s)]  # fmt: skip
    subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    db = Store(store)
    [job], _ = db.jobs()
    steps = db.steps(job.id)
    stages: dict[int, dict[str, float]] = {}
    for span in db.spans(job.id):
        per = stages.setdefault(span.step, {})
        per[span.stage] = per.get(span.stage, 0.0) + span.end - span.start
    evals = [{"step": m.step, "accuracy": m.value} for m in db.metrics(job.id, ["eval/accuracy"])]
    return {"steps": [{"step": s.step, "seconds": s.ended_at - s.started_at, **stages.get(s.step, {})} for s in steps],
            "evals": evals}  # fmt: skip


# ---- the comparison ---------------------------------------------------------------------------------------------
def to_target(run: dict, target: float, eval_s: dict[int, float] | None = None) -> tuple[int | None, float | None]:
    """(steps, seconds of the steps up to the first evaluation at the target, evaluation left out)."""
    reached = next((e["step"] for e in sorted(run["evals"], key=lambda e: e["step"]) if e["accuracy"] >= target), None)
    if reached is None:
        return None, None
    seconds = sum(s["seconds"] - s.get("eval", 0.0) for s in run["steps"] if s["step"] <= reached)
    return reached, seconds


def split(run: dict, peer: bool) -> tuple[float, float, float, float | None]:
    """Mean seconds of a step (evaluation left out), its generation and train parts, and the rest: None for TRL,
    whose step is timed as generation and everything else (its "train" holds its own bookkeeping; not measured
    apart)."""
    steps = run["steps"][1:] or run["steps"]  # the first step warms caches up
    if peer:
        gen = statistics.mean(s.get("generate_s", 0.0) for s in steps)
        total = statistics.mean(s["seconds"] for s in steps)
        return total, gen, total - gen, None
    total = statistics.mean(s["seconds"] - s.get("eval", 0.0) for s in steps)
    gen = statistics.mean(s.get("rollout", 0.0) for s in steps)
    train = statistics.mean(s.get("train", 0.0) for s in steps)
    return total, gen, train, total - gen - train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", nargs="*", default=["hf"], choices=["hf", "sglang"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 steps of a tiny batch: a smoke run")
    parser.add_argument("--out", type=Path, help="also write the report here (Markdown)")
    parser.add_argument("--trl-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    model_dir = model_folder()
    if args.trl_child:
        run_trl(model_dir, size, args.trl_child)
        return
    rows = []
    for round_ in range(1, args.repeats + 1):
        with tempfile.TemporaryDirectory(prefix="miles-peer-") as tmp:
            work = Path(tmp)
            child = [sys.executable, __file__, "--trl-child", str(work / "trl.json")] + (
                ["--quick"] if args.quick else []
            )
            subprocess.run(child, check=True)
            trl = json.loads((work / "trl.json").read_text())
            runs = [("TRL GRPOTrainer", trl, True)]
            for engine in args.engines:
                (work / engine).mkdir()
                runs.append((f"Miles, {engine} engine, sync", run_miles(engine, size, work / engine), False))
            base = None
            for name, run, peer in runs:
                steps, seconds = to_target(run, size["target"])
                per, gen, train, other = split(run, peer)
                base = base or (per, seconds)
                rows.append([round_, name, steps or "not reached", seconds if seconds is not None else "",
                             per, gen, train, "(in train)" if other is None else other, per / base[0],
                             seconds / base[1] if seconds and base[1] else ""])  # fmt: skip
    header = ["round", "run", "steps to target", "s to target", "s per step", "generation", "train", "other",
              "per step vs TRL", "to target vs TRL"]  # fmt: skip
    report = (
        f"Target: held-out accuracy {size['target']} (greedy, {size['eval_prompts']} prompts, every "
        f"{size['eval_every']} steps); {size['prompts']} prompts × {size['samples']} samples a step. Seconds leave "
        "evaluation out.\n\n" + table(header, rows)
    )
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
