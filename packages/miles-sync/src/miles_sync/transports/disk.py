"""disk: one safetensors file per bucket in a version folder, plus a manifest.

A version folder is written under a temporary name and renamed when complete, so a receiver
never sees a half-written version.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from miles_sync.config import DiskSync
from miles_sync.protocol import LoadsFolder, LoadsTensors
from miles_sync.transports.base import BucketedSender
from miles_sync.types import DiskHandle, NamedTensor

NAME = "disk"
MANIFEST = "manifest.json"


class DiskSender(BucketedSender):
    name = NAME

    def __init__(self, config: DiskSync, receiver_ranks: int = 1) -> None:
        super().__init__(config, receiver_ranks)
        self._published: list[Path] = []
        if config.dir is None:
            self._root = Path(tempfile.mkdtemp(prefix="miles-weights-"))
            self._owns_root = True
        else:
            self._root = Path(config.dir)
            self._root.mkdir(parents=True, exist_ok=True)
            self._owns_root = False

    @property
    def root(self) -> Path:
        return self._root

    def _begin(self, weight_version: int) -> None:
        self._final = self._root / f"v{weight_version:08d}"
        self._staging = Path(tempfile.mkdtemp(prefix=f".v{weight_version:08d}-", dir=self._root))
        self._files: list[dict] = []

    def _put_bucket(self, index: int, bucket: list[NamedTensor]) -> None:
        file_name = f"bucket-{index:05d}.safetensors"
        save_file(_writable(bucket), str(self._staging / file_name))
        self._files.append({"file": file_name, "names": [name for name, _ in bucket]})

    def _finish(self, common: dict) -> DiskHandle:
        handle = DiskHandle(**common, location=str(self._final))
        manifest = dataclasses.asdict(handle)
        manifest["files"] = self._files
        (self._staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if self._final.exists():
            shutil.rmtree(self._final)
        self._staging.rename(self._final)
        self._prune()
        return handle

    def _prune(self) -> None:
        # Only versions this sender wrote: the folder may be shared with other runs.
        if self._final not in self._published:
            self._published.append(self._final)
        while len(self._published) > self.config.keep_versions:
            shutil.rmtree(self._published.pop(0), ignore_errors=True)

    def close(self) -> None:
        if self._owns_root:
            shutil.rmtree(self._root, ignore_errors=True)


def _writable(bucket: list[NamedTensor]) -> dict[str, torch.Tensor]:
    """The bucket as safetensors writes it: contiguous tensors, one per storage. Only the tensors that are not
    get a copy (a non-contiguous view, a second view of a storage already in the bucket); the others are written
    from where they are, so a byte is copied once, into the file."""
    seen: set[int] = set()
    out = {}
    for name, tensor in bucket:
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen:
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        elif not tensor.is_contiguous():
            tensor = tensor.contiguous()
        storage = tensor.untyped_storage().data_ptr()
        seen.add(storage)
        out[name] = tensor
    return out


Sender = DiskSender


def read(handle: DiskHandle) -> Iterator[list[NamedTensor]]:
    folder = Path(handle.location)
    manifest_path = folder / MANIFEST
    if not manifest_path.exists():
        raise FileNotFoundError(f"weight version {handle.weight_version}: no {MANIFEST} in {folder}")
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["files"]:
        tensors = load_file(str(folder / entry["file"]))
        yield [(name, tensors[name]) for name in entry["names"]]


def receive(handle: DiskHandle, engine: LoadsTensors) -> None:
    """Servers that read the folder themselves do (`LoadsFolder`); any other engine takes the tensors."""
    if isinstance(engine, LoadsFolder):
        engine.load_folder(handle, read(handle))
    else:
        engine.load_tensors(handle, read(handle))
