"""What the group transports (`broadcast`, `p2p`) share: a weight group per version, formed by a sender that
listens before it hands out the handle, buckets as flat byte tensors, and a background sending thread.

The group of a version is created the way SGLang's `/init_weights_update_group` creates its side (TCP rendezvous
at `master_address:master_port`, a store prefixed with the group name), so an SGLang server joins it as a
receiving rank. The trainer's rank 0 opens the rendezvous store inside `publish` (`listen`): the port is bound
before any receiver is told about it, so no other process can take it in between, and a taken `master_port`
fails the publish itself. `master_address: 0.0.0.0` (the store listens on every interface anyway) advertises
this host's address, for receivers or trainer ranks on other nodes.
"""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from miles_sync.config import GroupSync
from miles_sync.transports.base import BucketedSender
from miles_sync.types import BucketLayout, NamedTensor, Rendezvous

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
WILDCARD = ("0.0.0.0", "::", "")


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def nbytes(dtype: str, shape: list[int]) -> int:
    return torch.Size(shape).numel() * getattr(torch, dtype).itemsize


def flatten(bucket: list[NamedTensor]) -> torch.Tensor:
    return torch.cat([tensor.reshape(-1).view(torch.uint8) for _, tensor in bucket])


def unflatten(flat: torch.Tensor, layout: BucketLayout) -> list[NamedTensor]:
    out, offset = [], 0
    for name, dtype, shape in layout:
        size = nbytes(dtype, shape)
        out.append((name, flat[offset : offset + size].view(getattr(torch, dtype)).reshape(shape)))
        offset += size
    return out


def aligned(layout: BucketLayout) -> bool:
    """Each tensor of a flat bucket must start at a multiple of its element size (SGLang checks this)."""
    offset = 0
    for _, dtype, shape in layout:
        itemsize = getattr(torch, dtype).itemsize
        if offset % itemsize:
            return False
        offset += torch.Size(shape).numel() * itemsize
    return True


def advertised(address: str) -> str:
    """The address receivers connect to: `address`, or this host's when it is a wildcard."""
    if address not in WILDCARD:
        return address
    own = socket.gethostbyname(socket.gethostname())
    if own.startswith("127."):
        raise ValueError(
            f"sync.master_address: {address!r} advertises this host's address, but its name "
            f"{socket.gethostname()!r} resolves to {own} (loopback), which other nodes cannot reach; set "
            "sync.master_address to an address of this host that they reach"
        )
    return own


def listen(address: str, port: int | None, world_size: int, timeout_s: float) -> Any:
    """Open a version's rendezvous store now (port None: a free one, read back from the store), so the port is
    held from the moment it is chosen."""
    from torch.distributed import TCPStore

    timeout = timedelta(seconds=timeout_s)
    host = advertised(address)
    try:
        return TCPStore(host, port or 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    except Exception as exc:
        raise RuntimeError(f"weight group: cannot listen on {address}:{port or 'a free port'}: {exc}") from exc


def group_name(prefix: str, weight_version: int) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}-v{weight_version}"


def join_group(r: Rendezvous, rank: int, store: Any = None) -> Any:
    """Create or join the weight-update group as `rank` (blocks until all ranks are there); `store`: the one rank 0
    opened with `listen` (the other ranks connect to it)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=r.timeout_s)
    world_size = r.world_size
    if store is None:
        store, rank, world_size = next(
            rendezvous(f"tcp://{r.master_address}:{r.master_port}", rank, r.world_size, timeout=timeout)
        )
    store.set_timeout(timeout)
    store = PrefixStore(r.group_name, store)
    # torch.distributed has no public call for a group outside the default world; SGLang's side uses this one.
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(r.backend), store, group_name=r.group_name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def gloo_group(r: Rendezvous, rank: int, store: Any = None) -> Any:
    """A gloo rank built directly on ProcessGroupGloo, on the store layout `join_group` gives (rendezvous store →
    PrefixStore(group name) → torch's f"{group name}/" → f"{device}/"). Not registered in torch.distributed's
    global registry, so one process (a test) may hold several ranks of a group."""
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    timeout = timedelta(seconds=r.timeout_s)
    if store is None:
        store = TCPStore(r.master_address, r.master_port, r.world_size, is_master=False, timeout=timeout)
    prefixed = PrefixStore("cpu/", PrefixStore(f"{r.group_name}/", PrefixStore(r.group_name, store)))
    return ProcessGroupGloo(prefixed, rank, r.world_size, timeout)


class GroupSender(BucketedSender):
    """A sender whose versions travel in a weight group: sends in a background thread, one version at a time."""

    config: GroupSync

    def __init__(self, config: GroupSync, receiver_ranks: int = 1) -> None:
        super().__init__(config, receiver_ranks)
        if receiver_ranks < 1:
            raise ValueError(f"{self.name} transport: receiver_ranks must be at least 1, got {receiver_ranks}")
        self.backend = config.backend if config.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
        self._thread: threading.Thread | None = None
        self._num_buckets = 0
        self._error: BaseException | None = None
        self._store: Any = None  # the rendezvous store of the version in flight (rank 0)
        self._flats: list[torch.Tensor] = []  # the flat buckets of the version being published

    def _keep_flat(self, bucket: list[NamedTensor]) -> list[NamedTensor]:
        """Keep `bucket` as one flat byte tensor to send, widest elements first; return it in that order.

        Widest first, every tensor starts at a multiple of its element size in the flat bytes (SGLang refuses
        unaligned ones). Flattened now, the one copy the wire format needs is also the version's own: training
        goes on updating its tensors while the version is sent (a clone first, flattened later in the sending
        thread, would copy every byte twice)."""
        bucket = sorted(bucket, key=lambda pair: -pair[1].element_size())
        self._flats.append(flatten(bucket))
        return bucket

    def _listen(self, world_size: int) -> Any:
        """Open this version's rendezvous store on the configured address and port (see `listen`)."""
        return listen(self.config.master_address, self.config.master_port, world_size, self.config.timeout_s)

    def _describe_group(self, master_port: int, name: str, world_size: int) -> Rendezvous:
        """The rendezvous a handle carries for a version's group of `world_size` ranks named `name`."""
        return Rendezvous(
            master_address=advertised(self.config.master_address),
            master_port=master_port,
            group_name=name,
            world_size=world_size,
            backend=self.backend,
            timeout_s=self.config.timeout_s,
        )

    def _start(self, target: Callable[..., None], num_buckets: int, *args: Any) -> None:
        """Run `target(*args)` in the sending thread; what it raises is reported by `wait()`."""

        def run() -> None:
            try:
                target(*args)
            except BaseException as exc:
                self._error = exc

        self._error, self._num_buckets = None, num_buckets
        self._thread = threading.Thread(target=run, name=f"miles-{self.name}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the last published version went to every receiver; raise the sending error if any. The
        rendezvous and each bucket have `timeout_s` each, and the sending thread fails on its own past them."""
        timeout_s = self.config.timeout_s * (1 + self._num_buckets)
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(
                    f"{self.name} transport: {self._who()}receivers did not take the weights in {timeout_s} s"
                )
            self._thread = None
        self._store = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"{self.name} transport: {self._who()}sending failed: {error}") from error

    def _who(self) -> str:
        return ""

    def close(self) -> None:
        self.wait()
