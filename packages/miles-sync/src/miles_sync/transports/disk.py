"""disk: one file per bucket in a version folder, plus a manifest.

A bucket is a safetensors file, or with `compression: zstd` one zstd frame of its tensors' bytes, each tensor
byte-shuffled first (the k-th byte of every element together, as HDF5's shuffle filter does: the exponent bytes of
neighbouring weights are alike, so bf16 weights compress about 1.46× instead of 1.28× unshuffled). A delta push
(`sync.delta`) writes only the tensors that changed. A version folder is written under a temporary name and renamed
when complete, so a receiver never sees a half-written version.

Engines whose servers read a folder themselves (`LoadsFolder`: SGLang) do so for a whole, uncompressed version;
a compressed or delta version is read in the engine's process and handed on as tensors.
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
from miles_sync.transports.base import BucketedSender, Transport
from miles_sync.transports.group import dtype_name, nbytes
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
        names = [name for name, _ in bucket]
        if self.config.compression == "zstd":
            file_name = f"bucket-{index:05d}.zst"
            layout = [(name, dtype_name(t.dtype), list(t.shape)) for name, t in bucket]
            _write_zstd(self._staging / file_name, bucket, self.config.compression_level)
            self._files.append({"file": file_name, "names": names, "layout": layout})
            return
        file_name = f"bucket-{index:05d}.safetensors"
        save_file(_writable(bucket), str(self._staging / file_name))
        self._files.append({"file": file_name, "names": names})

    def _finish(self, common: dict) -> DiskHandle:
        handle = DiskHandle(**common, location=str(self._final), compression=self.config.compression)
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


def _shuffled(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes with the k-th byte of every element together (one copy; none for 1-byte elements)."""
    flat = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
    size = tensor.element_size()
    return flat if size == 1 else flat.reshape(-1, size).t().contiguous()


def _unshuffled(raw: torch.Tensor, dtype: str, shape: list[int]) -> torch.Tensor:
    dt = getattr(torch, dtype)
    size = dt.itemsize
    flat = raw if size == 1 else raw.reshape(size, -1).t().clone(memory_format=torch.contiguous_format).reshape(-1)
    return flat.view(dt).reshape(shape)


def _write_zstd(path: Path, bucket: list[NamedTensor], level: int) -> None:
    import zstandard

    total = sum(t.numel() * t.element_size() for _, t in bucket)
    with path.open("wb") as f, zstandard.ZstdCompressor(level=level, threads=-1).stream_writer(f, size=total) as out:
        for _, tensor in bucket:
            out.write(memoryview(_shuffled(tensor).numpy()))  # type: ignore[arg-type]


def _read_zstd(path: Path, layout: list[list]) -> list[NamedTensor]:
    import zstandard

    raw = torch.frombuffer(bytearray(zstandard.ZstdDecompressor().decompress(path.read_bytes())), dtype=torch.uint8)
    listed = sum(nbytes(dtype, shape) for _, dtype, shape in layout)
    if listed != raw.numel():
        raise ValueError(f"{path}: holds {raw.numel()} bytes but its manifest lists {listed}")
    out, offset = [], 0
    for name, dtype, shape in layout:
        size = nbytes(dtype, shape)
        out.append((name, _unshuffled(raw[offset : offset + size], dtype, shape)))
        offset += size
    return out


def read(handle: DiskHandle) -> Iterator[list[NamedTensor]]:
    folder = Path(handle.location)
    manifest_path = folder / MANIFEST
    if not manifest_path.exists():
        raise FileNotFoundError(f"weight version {handle.weight_version}: no {MANIFEST} in {folder}")
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["files"]:
        if "layout" in entry:  # compressed
            yield _read_zstd(folder / entry["file"], entry["layout"])
            continue
        tensors = load_file(str(folder / entry["file"]))
        yield [(name, tensors[name]) for name in entry["names"]]


def receive(handle: DiskHandle, engine: LoadsTensors) -> None:
    """Servers that read the folder themselves do (`LoadsFolder`) when it is a whole, uncompressed checkpoint; any
    other engine, or any other version, takes the tensors read here."""
    if isinstance(engine, LoadsFolder) and handle.base_version is None and handle.compression == "none":
        engine.load_folder(handle, read(handle))
    else:
        engine.load_tensors(handle, read(handle))


TRANSPORT = Transport(NAME, DiskSender, read, receive)
