"""Tensors in shared memory, handed between processes of one machine as short strings.

A tensor moved into shared memory and pickled with torch's multiprocessing reducers (`ForkingPickler`), then
base64-encoded, is rebuilt by any process on the same machine without copying its bytes. This is the payload
format of SGLang's `/update_weights_from_tensor` (`serialized_named_tensors`) and of the `tensor` transport's
handles. On GPU the same reducers produce CUDA IPC handles for CUDA tensors.

On CPU the sharing strategy must be `file_system`: with `file_descriptor` a payload holds file descriptors that
only travel over a Unix socket, and an HTTP receiver such as SGLang rejects it. `file_system` storages are files
under /dev/shm; torch reference-counts them, but every pickling adds a reference that only an unpickling takes
back, so whoever shares must release what nobody read (`release_files`).
"""

from __future__ import annotations

import base64
import io
import os
import pickle
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.multiprocessing

from miles_sync.types import NamedTensor


def use_file_system_sharing() -> None:
    """Process-wide: CPU shared-memory tensors are named files, so their handles survive JSON/HTTP."""
    if torch.multiprocessing.get_sharing_strategy() != "file_system":
        torch.multiprocessing.set_sharing_strategy("file_system")


def serialize_bucket(bucket: list[NamedTensor]) -> str:
    """Pickle `(name, tensor)` pairs with torch's shared-memory reducers; base64 text."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(bucket)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize_bucket(payload: str) -> list[NamedTensor]:
    # Payloads come from our own sender in a handle; they are never taken from a request body.
    return pickle.loads(base64.b64decode(payload))


def into_shared(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in shared memory, made with one copy of its bytes: the shared storage is allocated in
    /dev/shm and filled (`clone().share_memory_()` copies twice, and `empty_like().share_memory_()` copies the
    empty bytes once)."""
    if tensor.device.type != "cpu":
        return tensor.clone(memory_format=torch.contiguous_format)
    out = new_shared(tensor.numel() * tensor.element_size(), tensor.device).view(tensor.dtype).view(tensor.shape)
    out.copy_(tensor)
    return out


def new_shared(num_bytes: int, device: torch.device) -> torch.Tensor:
    """An uninitialized byte buffer in shared memory (on CUDA: device memory, shared by IPC handles when
    pickled). Allocated there directly: `empty(...).share_memory_()` would copy the empty bytes over once."""
    if device.type != "cpu":
        return torch.empty(num_bytes, dtype=torch.uint8, device=device)
    storage = torch.UntypedStorage._new_shared(num_bytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (num_bytes,))


def shm_file(tensor: torch.Tensor) -> str | None:
    """The /dev/shm name behind a CPU tensor shared with the `file_system` strategy."""
    if tensor.device.type != "cpu":
        return None  # CUDA IPC memory is released with the tensor
    _, name, _ = tensor.untyped_storage()._share_filename_cpu_()
    return name.decode() if isinstance(name, bytes) else name


def release_files(buckets: list[list[NamedTensor]] | list[list[torch.Tensor]], files: list[str]) -> None:
    """Free tensors this process put in shared memory, including `files` that unread payloads still pin.

    The tensors are dropped first: torch unlinks a file itself when its last reference goes, and aborts the
    process if the file is already gone then. Only files that survive (a payload nobody read keeps a
    reference) are unlinked here; processes that mapped them keep their memory, but one that reads a payload
    of an unlinked file fails, so a file another process may still read must not be passed here.
    """
    for bucket in buckets:
        bucket.clear()
    buckets.clear()
    for name in files:
        try:
            os.unlink(Path("/dev/shm") / name.lstrip("/"))
        except FileNotFoundError:
            pass
