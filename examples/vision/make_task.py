"""The counting task's data and a tiny vision-language model to try it with, made from code:

    python examples/vision/make_task.py            # writes examples/vision/data/ and examples/vision/tiny-vlm/
    miles run examples/vision/counting.yaml

The training prompts go to a Parquet file with a `datasets` Image column, the held-out ones to a JSONL file of
image paths (both forms Miles reads). The model is a tiny Qwen2.5-VL (`--family qwen3_vl` for Qwen3-VL) with its
processor, random, then warm-started with supervised steps on other counting images until its greedy held-out
accuracy reaches `--warm-start-target` (as the demo's model is on arithmetic): RL needs a policy that is right
sometimes. `--warm-start-target 0` leaves it random.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from miles_control.testing.tiny_models import save_tiny_vision_model
from miles_rollout.tasks.counting import QUESTION, counting_rows, write_jsonl, write_parquet

HERE = Path(__file__).resolve().parent


def warm_start(folder: Path, target: float, seed: int, max_steps: int = 400) -> dict:
    """Supervised steps (batches of 64, lr 3e-3) on counting images of another seed than the data's, until the greedy
    answer to 200 other images is right `target` of the time; the model is saved over the random one."""
    import torch

    from miles_rollout.prompts import load_encoder
    from miles_rollout.types import PromptRecord
    from miles_train.backends.fsdp2.convert import load_hf_model
    from miles_train.sft import as_batch, supervised_finetune

    encoder = load_encoder(folder, "model")
    eos = encoder.tokenizer.eos_token_id

    def examples(rows):
        return [(encoder.inputs(PromptRecord(QUESTION, label, images=[image])), encoder.tokenizer.encode(label) + [eos])
                for image, label in rows]  # fmt: skip

    train, held_out = examples(counting_rows(4000, seed + 10_000)), examples(counting_rows(200, seed + 20_000))
    model = load_hf_model(folder, torch.device("cpu"))
    progress = {"steps": 0, "accuracy": 0.0}

    @torch.no_grad()
    def reached() -> bool:  # the first answer token, greedy, against the label's
        from miles_train.collate import collate

        c = collate(as_batch(held_out), encoder.tokenizer.pad_token_id)
        logits = model(input_ids=c.input_ids, attention_mask=c.attention_mask, **c.model_inputs).logits
        hits = [int(logits[i, len(p[0]) - 1].argmax()) == answer[0] for i, (p, answer) in enumerate(held_out)]
        progress["accuracy"] = sum(hits) / len(hits)
        return progress["accuracy"] >= target

    loss = supervised_finetune(model, train, max_steps, 64, 3e-3, seed, encoder.tokenizer.pad_token_id,
                               on_step=lambda step, _: progress.update(steps=step + 1), done=reached, check_every=5)  # fmt: skip
    reached()
    partial = folder.with_name(folder.name + ".warm")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(folder, partial)
    model.save_pretrained(partial)  # the weights; the processor files are the copy's
    info = {"warm_start_steps": progress["steps"], "warm_start_accuracy": progress["accuracy"], "loss": loss}
    (partial / "warm_start.json").write_text(json.dumps(info))
    shutil.rmtree(folder)
    partial.rename(folder)
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE, help="where data/ and tiny-vlm/ go")
    parser.add_argument("--family", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl"])
    parser.add_argument("--num-train", type=int, default=512)
    parser.add_argument("--num-eval", type=int, default=128)
    parser.add_argument("--warm-start-target", type=float, default=0.4)
    parser.add_argument("--seed", type=int, default=0, help="the model's weights and its warm start")
    args = parser.parse_args()
    write_parquet(counting_rows(args.num_train, seed=0), args.out / "data" / "train.parquet")
    write_jsonl(counting_rows(args.num_eval, seed=1), args.out / "data" / "eval.jsonl")
    model = args.out / "tiny-vlm"
    if (model / "config.json").exists():
        family = json.loads((model / "config.json").read_text()).get("model_type")
        if family != args.family:
            raise SystemExit(f"{model} holds a {family} model, not {args.family}: remove it first")
    save_tiny_vision_model(model, args.family, seed=args.seed)
    # warm-started once: a model whose warm start was interrupted (no warm_start.json) is warm-started again
    if args.warm_start_target > 0 and not (model / "warm_start.json").exists():
        info = warm_start(model, args.warm_start_target, args.seed)
        print(f"warm start: {info['warm_start_steps']} steps, held-out accuracy {info['warm_start_accuracy']:.2f}")
    print(f"data in {args.out / 'data'}, model in {model}")


if __name__ == "__main__":
    main()
