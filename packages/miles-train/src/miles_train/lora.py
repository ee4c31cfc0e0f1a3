"""LoRA adapters (`train.lora`) through PEFT: wrapping a transformers model, the adapter's names on the wire and on
disk, merging it into the base weights, and its checkpoint folder.

Names: the adapter's matrices travel under PEFT's `save_pretrained` names (miles_sync.naming), the wrapped linear's
own weight is `<module>.base_layer.weight` inside the model, and merged weights travel under the model's own names
(`<module>.weight`), as a full push does.
"""

from __future__ import annotations

import contextlib
import json
import math
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from miles_sync.naming import LORA_ADAPTER_NAME as ADAPTER_NAME
from miles_sync.naming import is_lora as is_adapter
from miles_sync.naming import lora_wire_name as wire_name

ADAPTER_DIR = "adapter"  # inside a trainer checkpoint: the adapter in PEFT's save_pretrained layout
PEFT_PREFIX = "base_model.model."


INIT_SEED = 0  # A's random initialization: the same on every rank (and in every run), whatever torch's seed


def initial_a(name: str, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The start of the A matrix whose wire name is `name`: PEFT's default (kaiming-uniform, a = √5) drawn from a
    generator seeded by `INIT_SEED` and the name, so that every rank, every run and every backend starts from the
    same adapter whatever torch's seed (B starts at zero)."""
    generator = torch.Generator().manual_seed(INIT_SEED * 1_000_003 + zlib.crc32(name.encode()))
    a = torch.empty(tuple(shape))
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    return a


def wrap(model: torch.nn.Module, peft_kwargs: dict[str, Any], base_path: str | Path | None = None) -> Any:
    """`model` with an adapter on its `target_modules` (PEFT's `get_peft_model`): the base frozen, A from
    `initial_a`, B zero, so the wrapped model computes what `model` did until the adapter trains."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(**peft_kwargs, base_model_name_or_path=None if base_path is None else str(base_path))
    try:
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):  # PEFT's own draws leave torch's generators as they were
            wrapped = get_peft_model(model, config)
    except ValueError as exc:  # PEFT: "Target modules {...} not found in the base model"
        raise ValueError(
            f"train.lora.target_modules {peft_kwargs['target_modules']}: {exc} (the model's linear modules: "
            f"{', '.join(sorted(linear_module_names(model)))})"
        ) from exc
    with torch.no_grad():
        for name, param in adapter_params(wrapped).items():
            if ".lora_A." in name:
                param.copy_(initial_a(name, param.shape))
    return wrapped


def linear_module_names(model: torch.nn.Module) -> set[str]:
    """The last name parts of the model's linear modules (what `target_modules` matches), less the LM head."""
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)} - {
        "lm_head"
    }


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT wrapper (the model itself when it has none)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """Within the block `model` computes its frozen base: every PEFT adapter layer is switched off (PEFT's
    `enable_adapters(False)`, what `PeftModel.disable_adapter` does, for a PEFT wrapper or adapters injected into
    another model), then on again."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class AdapterOff:
    """The KL reference of a LoRA policy without a second copy of the model: calling it runs the policy's own model
    with its adapter switched off, which is the frozen base the adapter started from (what a copy of the checkpoint
    would compute, at none of its memory)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with adapters_off(self.model):
            return self.model(*args, **kwargs)


def adapter_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The adapter's parameters of a PEFT-wrapped model under their wire names."""
    return {wire_name(n): p for n, p in model.named_parameters() if is_adapter(n)}


def merged(state: dict[str, torch.Tensor], scaling: float, prefix: str = PEFT_PREFIX) -> dict[str, torch.Tensor]:
    """The model's own state dict from a PEFT-wrapped model's full one: each adapted linear's weight is
    W + scaling · B A (computed in fp32), its other tensors (a bias) keep their names, the adapter goes. `prefix`:
    what PEFT's wrapper puts before the model's names (none where the adapter was injected in place)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_adapter(name):
            continue
        plain = name.removeprefix(prefix)
        if ".base_layer." not in plain:
            out[plain] = tensor
            continue
        module, _, leaf = plain.rpartition(".base_layer.")
        if leaf == "weight":
            a = state[f"{prefix}{module}.lora_A.{ADAPTER_NAME}.weight"].float()
            b = state[f"{prefix}{module}.lora_B.{ADAPTER_NAME}.weight"].float()
            tensor = (tensor.float() + scaling * (b @ a)).to(tensor.dtype)
        out[f"{module}.{leaf}"] = tensor
    return out


def adapter_config_json(peft_kwargs: dict[str, Any], base_path: str | Path | None) -> dict[str, Any]:
    """`adapter_config.json` as PEFT writes it for this adapter (PEFT's own serialization)."""
    from peft import LoraConfig

    config = LoraConfig(**peft_kwargs, base_model_name_or_path=None if base_path is None else str(base_path))
    config.task_type = "CAUSAL_LM"
    return config.to_dict()


def save_adapter(
    directory: str | Path, peft_kwargs: dict[str, Any], base_path: str | Path | None, tensors: Iterable
) -> Path:
    """Write the adapter as PEFT's `save_pretrained` does: `adapter_config.json` + `adapter_model.safetensors`
    (wire names, the tensors as given); loadable by `PeftModel.from_pretrained` and SGLang's `--lora-paths`."""
    from safetensors.torch import save_file

    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    config = adapter_config_json(peft_kwargs, base_path)
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=list))
    save_file({name: t.detach().contiguous().cpu() for name, t in tensors}, str(folder / "adapter_model.safetensors"))
    return folder


def read_adapter(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json, the tensors under wire names) of a folder `save_adapter` (or PEFT) wrote."""
    from safetensors.torch import load_file

    folder = Path(directory)
    config_file, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for file in (config_file, weights):
        if not file.is_file():
            raise FileNotFoundError(f"{folder} holds no LoRA adapter: {file.name} is missing")
    return json.loads(config_file.read_text()), load_file(str(weights))


def check_same_adapter(saved: dict[str, Any], peft_kwargs: dict[str, Any], where: str) -> None:
    """Raise naming each train.lora field in which an adapter folder's config differs from the job's."""
    fields = {"r": "rank", "lora_alpha": "alpha", "target_modules": "target_modules"}
    differ = []
    for key, field in fields.items():
        mine, theirs = peft_kwargs[key], saved.get(key)
        if key == "target_modules":
            mine, theirs = sorted(mine), sorted(theirs or [])
        if mine != theirs:
            differ.append(f"{field} {theirs} (this job: {mine})")
    if differ:
        raise ValueError(f"train.lora: the adapter in {where} was trained with {'; '.join(differ)}")


def scaling_of(peft_kwargs: dict[str, Any]) -> float:
    """PEFT's scale of the update B A: alpha / rank."""
    return float(peft_kwargs["lora_alpha"]) / float(peft_kwargs["r"])


def full_adapter(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter's matrices whole under wire names (a DTensor gathered: a collective every rank runs in the same
    order); every rank yields them."""
    for name, param in adapter_params(model).items():
        yield name, (param.full_tensor() if hasattr(param, "full_tensor") else param).detach()
