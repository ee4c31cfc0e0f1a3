"""LoRA adapters on SGLang (`sync.lora: adapter`): each pushed version of the adapter is served by name.

The servers start with SGLang's LoRA support on (`--enable-lora`, `server_flags`) and keep the base weights they
loaded. A push's tensors (PEFT's save names) are read in this process, written as PEFT's folder (adapter_config.json
+ adapter_model.safetensors) and loaded into every server under the version's name (`/load_lora_adapter`). Every
call made afterwards names that adapter (`lora_path`), so each of its tokens is of that version; a call already
running keeps the adapter it started with, so a push never pauses the servers: it holds new calls for the load
alone. An adapter is unloaded at a later push, once no call uses it and a roll-back cannot need it.

The weight check compares the fingerprint of the folder the servers read (read back from disk, in the push's wire
dtype) with the trainer's, and every server must report the adapter loaded. SGLang offers no read-back of an
adapter it holds, so unlike a full push (`/weights_checker`) the check stops at what the servers were given.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from miles_rollout.engines.sglang.calls import ServerCalls
from miles_rollout.engines.sglang.router import Slot
from miles_sync import WeightHandle, is_lora, receive
from miles_sync.protocol import Buckets


def server_flags(peft_kwargs: dict[str, Any], on_cpu: bool) -> list[str]:
    """`sglang.launch_server` flags that serve adapters of this configuration (on CPU: the torch-native LoRA
    kernels; SGLang's default ones are Triton's)."""
    flags = ["--enable-lora", "--max-lora-rank", str(peft_kwargs["r"]), "--lora-target-modules"]
    flags += list(peft_kwargs["target_modules"])
    return flags + (["--lora-backend", "torch_native"] if on_cpu else [])


def adapter_name(version: int) -> str:
    """The name a version's adapter is served under."""
    return f"miles-v{version}"


class AdapterServing:
    """The adapters an engine's servers hold, which one new calls use, and the calls that use each."""

    name = "sglang"

    def __init__(self, peft_kwargs: dict[str, Any], folder: Path, slots: list[Slot], calls: ServerCalls) -> None:
        self.peft_kwargs = dict(peft_kwargs)
        self.folder = folder
        self.slots, self.calls = slots, calls
        self.current: int | None = None  # None: the base model alone (before the first push)
        self.previous: int | None = None  # kept for roll_back() until drop_previous()
        self.fingerprint = ""
        self._previous_fingerprint = ""
        self._names: set[str] | None = None  # the matrices every version must hold (the first push's)
        self._loaded: set[int] = set()
        self._in_use: Counter[int] = Counter()
        self._lock = threading.Lock()
        self._received: dict[str, Any] = {}
        self.timing: dict[str, float] = {}
        from peft import LoraConfig  # here, not in the first push: importing PEFT takes most of a second

        config = LoraConfig(**self.peft_kwargs)
        config.task_type = "CAUSAL_LM"
        self._config_json = json.dumps(config.to_dict(), indent=2, default=list)  # adapter_config.json

    # ---- generation -----------------------------------------------------------------------------

    @contextmanager
    def checkout(self) -> Iterator[tuple[str | None, int]]:
        """(adapter name or None for the base, version) for one call; the adapter stays loaded while it runs."""
        with self._lock:
            version = self.current
            if version is not None:
                self._in_use[version] += 1
        try:
            yield (None if version is None else adapter_name(version)), (0 if version is None else version)
        finally:
            if version is not None:
                with self._lock:
                    self._in_use[version] -= 1

    # ---- a push -----------------------------------------------------------------------------------

    def receive(self, handle: WeightHandle, keep_previous: bool) -> str:
        """Load the adapter of `handle` into every admitted server and make it the one new calls use; returns the
        fingerprint of what the servers read. With `keep_previous` the adapter it replaces stays for `roll_back`."""
        import time

        began = time.time()
        receive(handle, self)  # calls load_tensors
        tensors, self._received = self._received, {}
        self.timing["read"] = time.time() - began
        folder = self._write(handle.weight_version, tensors)
        self.timing["write"] = time.time() - began - self.timing["read"]
        began = time.time()
        self._load_everywhere(handle.weight_version, folder)
        self.timing["servers"] = time.time() - began
        fingerprint = self._fingerprint_of(folder, handle.dtype)
        with self._lock:
            self.previous = self.current if keep_previous else None
            self._previous_fingerprint = self.fingerprint
            self.current = handle.weight_version
            self.fingerprint = fingerprint
        self._unload_unused()
        return fingerprint

    def load_tensors(self, handle: WeightHandle, buckets: Buckets) -> None:
        """The transports' receiver: read every bucket; refuse a version that is not a whole adapter."""
        if handle.base_version is not None:
            raise ValueError(
                f"sglang engine: weight version {handle.weight_version} is a delta push, and an adapter is loaded "
                "whole into SGLang; turn sync.delta off with sync.lora: adapter"
            )
        tensors = dict(pair for bucket in buckets for pair in bucket)
        foreign = sorted(n for n in tensors if not is_lora(n))
        if foreign:
            raise ValueError(
                f"sglang engine: weight version {handle.weight_version} is not a LoRA adapter (it holds "
                f"{foreign[:3]}); the engine serves adapters (sync.lora: adapter), so pushes must carry one"
            )
        if self._names is not None and set(tensors) != self._names:
            missing, extra = sorted(self._names - set(tensors)), sorted(set(tensors) - self._names)
            raise ValueError(
                f"sglang engine: weight version {handle.weight_version}'s adapter lacks {missing[:3]} / adds "
                f"{extra[:3]} against the adapter it replaces"
            )
        self._names = set(tensors)
        self._received = tensors

    def _write(self, version: int, tensors: dict[str, Any]) -> Path:
        from safetensors.torch import save_file

        folder = self.folder / adapter_name(version)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(self._config_json)
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / "adapter_model.safetensors"))
        return folder

    def _load_everywhere(self, version: int, folder: Path) -> None:
        name = adapter_name(version)
        for slot in [s for s in self.slots if s.admitted]:
            self._load_into(slot, name, folder)
        self._loaded.add(version)

    def _load_into(self, slot: Slot, name: str, folder: Path) -> None:
        answer = self.calls.post(slot.url, "/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        if not answer.get("success", False) or name not in (answer.get("loaded_adapters") or {}):
            raise RuntimeError(
                f"sglang engine {slot.url}: /load_lora_adapter did not load {name} from {folder}: "
                f"{answer.get('error_message') or answer}"
            )

    @staticmethod
    def _fingerprint_of(folder: Path, wire: str | None) -> str:
        """The fingerprint of the adapter as the servers read it, in the push's wire dtype."""
        import torch
        from safetensors.torch import load_file

        from miles_sync import weight_fingerprint

        tensors = load_file(str(folder / "adapter_model.safetensors"))
        return weight_fingerprint(tensors.items(), None if wire is None else getattr(torch, wire))

    def _unload_unused(self) -> None:
        with self._lock:
            kept = {self.current, self.previous}
            gone = [v for v in self._loaded if v not in kept and self._in_use[v] <= 0]
        for version in gone:
            for slot in [s for s in self.slots if s.admitted]:
                self.calls.post(slot.url, "/unload_lora_adapter", {"lora_name": adapter_name(version)})
            self._loaded.discard(version)
            shutil.rmtree(self.folder / adapter_name(version), ignore_errors=True)

    # ---- check, roll-back, recovery ---------------------------------------------------------------

    def roll_back(self) -> int:
        """New calls use the adapter the last push replaced again (kept by `keep_previous`)."""
        with self._lock:
            if self.current is None:
                raise RuntimeError("sglang engine: no adapter push to roll back")
            back = self.previous
            self.current, self.previous = back, None
            self.fingerprint = self._previous_fingerprint
        self._unload_unused()
        return 0 if back is None else back

    def drop_previous(self) -> None:
        with self._lock:
            self.previous = None

    def restore(self, slot: Slot) -> None:
        """A restarted or re-admitted server: load the adapters calls may still use that it does not hold (SGLang
        lists the adapters it holds among its models, `/v1/models`)."""
        listed = self.calls.client.get(f"{slot.url}/v1/models", timeout=30)
        listed.raise_for_status()
        held = {model.get("id") for model in listed.json().get("data", [])}
        for version in sorted(self._loaded):
            if adapter_name(version) not in held:
                self._load_into(slot, adapter_name(version), self.folder / adapter_name(version))
