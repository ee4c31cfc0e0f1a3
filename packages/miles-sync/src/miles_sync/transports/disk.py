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
from miles_sync.transports.base import BucketedSender
from miles_sync.types import NamedTensor, WeightHandle

MANIFEST = "manifest.json"


class DiskSender(BucketedSender):
    name = "disk"

    def __init__(self, config: DiskSync) -> None:
        super().__init__(config)
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

    def _finish(self, handle: WeightHandle) -> WeightHandle:
        handle = dataclasses.replace(handle, location=str(self._final))
        manifest = {k: v for k, v in dataclasses.asdict(handle).items() if k != "buckets"}
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


def read_disk(handle: WeightHandle) -> Iterator[list[NamedTensor]]:
    if handle.location is None:
        raise ValueError(f"disk handle for weight version {handle.weight_version} has no location")
    folder = Path(handle.location)
    manifest_path = folder / MANIFEST
    if not manifest_path.exists():
        raise FileNotFoundError(f"weight version {handle.weight_version}: no {MANIFEST} in {folder}")
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["files"]:
        tensors = load_file(str(folder / entry["file"]))
        yield [(name, tensors[name]) for name in entry["names"]]
