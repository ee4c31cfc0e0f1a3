"""Counting the copies a weight push makes: how many times each byte of a version is written in memory or to
files on its way, in the process and thread that measure (the benchmarks' "copies per byte").

`CopyCount` is a context manager. Inside it, every torch operation that writes a new copy of data (`copy_`,
`clone`, `_to_copy` (a cast or a device move), `cat`, `stack`, gathers by index) adds the bytes it wrote, counted
by torch's own dispatcher (a `TorchDispatchMode`, so nothing in Miles reports its own copies); and the bytes this
process wrote through system calls (files, sockets, pipes) and read with read(2) (files; bytes received on a socket
with recv(2), as gloo does, are not counted) are taken from `/proc/self/io` (`wchar`, `rchar`) at entry and exit. A memory-mapped read (a safetensors file mapped by the reader, a tensor mapped
from shared memory) is not a copy and counts nothing.

What it cannot see: other processes (an SGLang server's own load), and other threads' torch operations (a dispatch
mode holds for the thread that entered it; the background threads of `broadcast` and `p2p` only hand bytes to the
wire, which `wchar` counts when it is a socket of this process).
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
COPYING = frozenset(
    {
        _aten.copy_,
        _aten.clone,
        _aten._to_copy,
        _aten.cat,
        _aten.stack,
        _aten.index_select,
        _aten.index,
        _aten.gather,
    }
)


def _io() -> tuple[int, int]:
    """(bytes written, bytes read) by this process's system calls so far; (0, 0) where /proc is missing."""
    try:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    except OSError:
        return 0, 0
    return int(fields["wchar"]), int(fields["rchar"])


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class CopyCount(TorchDispatchMode):
    """Bytes copied by torch operations in this thread (`tensor_bytes`), and written / read by this process's
    system calls (`written_bytes`, `read_bytes`), between entry and exit. `per_byte(n)`: their sum over `n`."""

    def __init__(self) -> None:
        super().__init__()
        self.tensor_bytes = 0
        self.written_bytes = 0
        self.read_bytes = 0
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in COPYING:
            nbytes = _nbytes(out)
            self.tensor_bytes += nbytes
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + nbytes
        return out

    def __enter__(self) -> CopyCount:
        self._io = _io()
        super().__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        super().__exit__(kind, exc, tb)
        written, read = _io()
        self.written_bytes += written - self._io[0]
        self.read_bytes += read - self._io[1]

    @property
    def io_bytes(self) -> int:
        """Bytes through system calls: written to files and sockets, read from files."""
        return self.written_bytes + self.read_bytes

    @property
    def total_bytes(self) -> int:
        return self.tensor_bytes + self.written_bytes + self.read_bytes

    def per_byte(self, num_bytes: int) -> float:
        """How many times each of `num_bytes` was copied on average."""
        return self.total_bytes / num_bytes if num_bytes else 0.0
