"""`miles export`: a trained policy as a Hugging Face model folder.

Every backend (fsdp2, megatron, torchtitan) writes its checkpoints in one format (miles_train.backends.checkpoint):
the weights under HF names in `model.safetensors` (fp32 master weights, a tied head once) beside `config.json`, the
optimizer state and `trainer_state.json`. An export keeps the weights and the config, casts them to the chosen
dtype, and adds what the checkpoint does not hold from the job's model folder: the tokenizer (its chat template
with it) and the generation config. The result loads with `from_pretrained` and serves with SGLang or vLLM; the
optimizer state stays behind.

A LoRA checkpoint (`train.lora`) also holds its adapter in PEFT's layout (`adapter/`); its `model.safetensors` is the
merged model. `export_adapter` writes the adapter (for `PeftModel.from_pretrained` or SGLang's `--lora-paths`, on the
job's base model); `export_checkpoint` the merged model (`miles export --merged`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    # a vision-language model's processor (image and video processors, the processor's own settings)
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)


class ExportError(ValueError):
    """What cannot be exported; the message names the argument."""


def find_checkpoint(store_url: str, job_id: int, step: int | None = None) -> tuple[Path, Path | None]:
    """(checkpoint folder, the job's model folder) of job `job_id`: its newest checkpoint, or that of `step`."""
    from miles_control.service.store import Store
    from miles_control.service.store.base import shown_url

    store = Store(store_url)
    try:
        try:
            store.job(job_id)
        except Exception:
            raise ExportError(f"JOB_OR_CHECKPOINT: no job {job_id} in the store {shown_url(store_url)}") from None
        checkpoints = store.checkpoints(job_id)
        if step is not None:
            checkpoints = [c for c in checkpoints if c.step == step]
        if not checkpoints:
            saved = ", ".join(str(c.step) for c in store.checkpoints(job_id)) or "none"
            raise ExportError(
                f"job {job_id} has no checkpoint" + (f" of step {step}" if step is not None else "")
                + f" (steps saved: {saved}); set schedule.checkpoint_every or schedule.save_final"
            )  # fmt: skip
        checkpoint = max(checkpoints, key=lambda c: c.step)
        return Path(checkpoint.path), model_folder_of(store, job_id)
    finally:
        store.engine.dispose()


@contextmanager
def written_whole(out: Path) -> Iterator[Path]:
    """A folder to fill, written beside `out` (which must not exist, or be empty) and moved into place once the block
    ends without an error: a failed export leaves nothing."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"OUT: {out} exists and is not an empty folder; choose another (nothing was written)")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        yield staging
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def model_folder_of(store, job_id: int) -> Path | None:
    """The model folder the job ran (its `model` event), where its tokenizer is."""
    folders = [e.data.get("path") for e in store.events(job_id) if e.kind == "model"]
    return Path(folders[-1]) if folders and folders[-1] else None


def export_checkpoint(checkpoint: Path, out: Path, model_folder: Path | None = None, dtype: str = "auto") -> Path:
    """Write checkpoint `checkpoint` as an HF folder `out` (which must not exist or be empty): config, safetensors
    (sharded above 5 GB, with an index), tokenizer and generation config from `model_folder` (or the checkpoint,
    when it holds them). `dtype` auto: the dtype the model's config declares (what it ships in); or one named."""
    import torch
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    checkpoint, out = Path(checkpoint), Path(out)
    if dtype not in DTYPES:
        raise ExportError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    weights = checkpoint / "model.safetensors"
    if not (checkpoint / "config.json").is_file() or not weights.is_file():
        raise ExportError(f"JOB_OR_CHECKPOINT: {checkpoint} is not a Miles checkpoint (no config.json and "
                          "model.safetensors)")  # fmt: skip
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # before the weights are read
        raise ExportError(f"OUT: {out} exists and is not an empty folder; choose another (nothing was written)")
    source = model_folder if model_folder is not None else checkpoint
    if not any((source / name).is_file() for name in TOKENIZER_FILES):
        raise ExportError(
            f"no tokenizer in {source}: give --model the job's model folder (where its tokenizer is)"
            if model_folder is None
            else f"--model: {model_folder} holds no tokenizer files"
        )
    config = json.loads((checkpoint / "config.json").read_text())
    declared = config.get("torch_dtype") or config.get("dtype")
    chosen = declared if dtype == "auto" and declared in DTYPES[1:] else dtype
    state = load_file(str(weights))
    if chosen == "auto":  # the config declares none: keep the checkpoint's own
        chosen = str(next(iter(state.values())).dtype).removeprefix("torch.")
    target = getattr(torch, chosen)
    state = {name: t.to(target) if t.is_floating_point() else t for name, t in state.items()}
    with written_whole(out) as staging:
        config["torch_dtype"] = chosen
        if "dtype" in config:
            config["dtype"] = chosen
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_torch_state_dict(state, staging, max_shard_size="5GB")
        for name in (*TOKENIZER_FILES, "generation_config.json"):
            if (source / name).is_file():
                shutil.copy2(source / name, staging / name)
            elif name == "generation_config.json" and (checkpoint / name).is_file():
                shutil.copy2(checkpoint / name, staging / name)
    return out


def has_adapter(checkpoint: Path) -> bool:
    """True for a checkpoint of a LoRA job (train.lora): it holds `adapter/`."""
    return (Path(checkpoint) / "adapter" / "adapter_config.json").is_file()


def export_adapter(checkpoint: Path, out: Path, model_folder: Path | None = None, dtype: str = "auto") -> Path:
    """Write a LoRA checkpoint's adapter as PEFT's folder `out` (adapter_config.json naming the base model folder,
    adapter_model.safetensors in `dtype`: auto is the base model's), with the base's tokenizer where it is known."""
    import torch
    from safetensors.torch import load_file, save_file

    checkpoint, out = Path(checkpoint), Path(out)
    if dtype not in DTYPES:
        raise ExportError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if not has_adapter(checkpoint):
        raise ExportError(f"JOB_OR_CHECKPOINT: {checkpoint} holds no LoRA adapter (adapter/adapter_config.json)")
    adapter = checkpoint / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    if model_folder is not None:
        config["base_model_name_or_path"] = str(model_folder)
    if dtype == "auto":
        declared = json.loads((checkpoint / "config.json").read_text())
        dtype = declared.get("torch_dtype") or declared.get("dtype") or "float32"
        dtype = dtype if dtype in DTYPES[1:] else "float32"
    target = getattr(torch, dtype)
    state = {
        n: t.to(target) if t.is_floating_point() else t
        for n, t in load_file(str(adapter / "adapter_model.safetensors")).items()
    }
    with written_whole(out) as staging:
        (staging / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(state, str(staging / "adapter_model.safetensors"))
        for name in TOKENIZER_FILES if model_folder is not None else ():
            if (model_folder / name).is_file():
                shutil.copy2(model_folder / name, staging / name)
    return out
