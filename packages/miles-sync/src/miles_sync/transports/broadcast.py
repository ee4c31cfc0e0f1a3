"""broadcast: the trainer broadcasts each bucket over a torch.distributed group that the engines join.

Rank 0 is the sender (the trainer's rank 0); receivers take ranks 1..N (an SGLang server takes
`rank_offset + tp_rank`). The group is gloo on CPU and NCCL on GPU. It is created the way SGLang's
`/init_weights_update_group` creates its side (TCP rendezvous at `master_address:master_port`, a
store prefixed with the group name, `init_method` semantics of torch.distributed), so an SGLang
server and this module's own receiver join the same group.

`publish()` returns at once with a handle that names the group and lists every bucket's tensors
(name, dtype, shape); a background thread forms a fresh group for that version and broadcasts the
buckets in order, each as one flat byte tensor (SGLang's `flattened_bucket` load format). Receivers post/join with that handle; `wait()` blocks until
every bucket went out and raises what went wrong on the sender's side.
"""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta

import torch

from miles_sync.config import BroadcastSync
from miles_sync.protocol import JoinsGroup, LoadsTensors
from miles_sync.transports.base import BucketedSender
from miles_sync.types import BroadcastHandle, BucketLayout, NamedTensor, Rendezvous

NAME = "broadcast"

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


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def join_group(address: str, port: int, world_size: int, rank: int, group_name: str, backend: str, timeout_s: float):
    """Create or join the weight-update group (blocks until all `world_size` ranks are there)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # torch.distributed has no public call for a group outside the default world; SGLang's side uses this one.
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def flatten(bucket: list[NamedTensor]) -> torch.Tensor:
    return torch.cat([tensor.reshape(-1).view(torch.uint8) for _, tensor in bucket])


def unflatten(flat: torch.Tensor, layout: BucketLayout) -> list[NamedTensor]:
    out, offset = [], 0
    for name, dtype, shape in layout:
        dt = getattr(torch, dtype)
        size = torch.Size(shape).numel() * dt.itemsize
        out.append((name, flat[offset : offset + size].view(dt).reshape(shape)))
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


class BroadcastSender(BucketedSender):
    """Rank 0 of a weight-update group with `receiver_ranks` receiving ranks."""

    name = NAME
    needs_receiver_ranks = True

    def __init__(self, config: BroadcastSync, receiver_ranks: int = 1) -> None:
        super().__init__(config, receiver_ranks)
        if receiver_ranks < 1:
            raise ValueError(f"broadcast transport: receiver_ranks must be at least 1, got {receiver_ranks}")
        self.backend = config.backend if config.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
        self._thread: threading.Thread | None = None
        self._num_buckets = 0
        self._error: BaseException | None = None

    def _begin(self, weight_version: int) -> None:
        self.wait()  # one version at a time on the wire (at most timeout_s: receivers that never join fail here)
        self._buckets: list[list[NamedTensor]] = []
        self._layout: list[BucketLayout] = []

    def _put_bucket(self, index: int, bucket: list[NamedTensor]) -> None:
        # Widest elements first: every tensor then starts at a multiple of its element size in the flat
        # bytes (SGLang refuses unaligned ones). Own copies: the broadcast happens later, while the
        # trainer keeps updating its tensors.
        bucket = sorted(bucket, key=lambda pair: -pair[1].element_size())
        layout = [(name, dtype_name(t.dtype), list(t.shape)) for name, t in bucket]
        assert aligned(layout)
        self._buckets.append([(name, tensor.clone()) for name, tensor in bucket])
        self._layout.append(layout)

    def _finish(self, common: dict) -> BroadcastHandle:
        # A fresh group per version: a receiver that was restarted since the last push simply joins the
        # next one (a gloo group cannot take a new member). Forming one costs ~10 ms on loopback.
        address = self.config.master_address
        rendezvous = Rendezvous(
            master_address=address,
            master_port=self.config.master_port or _free_port(address),
            group_name=f"miles-weights-{uuid.uuid4().hex[:8]}-v{common['weight_version']}",
            world_size=1 + self.receiver_ranks,
            backend=self.backend,
            timeout_s=self.config.timeout_s,
        )
        buckets, self._error = self._buckets, None
        self._num_buckets = len(buckets)
        self._thread = threading.Thread(
            target=self._send, args=(rendezvous, buckets), name="miles-broadcast", daemon=True
        )
        self._thread.start()
        return BroadcastHandle(**common, group=rendezvous, layout=self._layout)

    def _send(self, r: Rendezvous, buckets: list[list[NamedTensor]]) -> None:
        group = None
        try:
            group = join_group(r.master_address, r.master_port, r.world_size, 0, r.group_name, r.backend, r.timeout_s)
            for bucket in buckets:
                flat = flatten(bucket)
                if self.backend == "nccl":
                    flat = flat.cuda()
                torch.distributed.broadcast(flat, src=0, group=group)
        except BaseException as exc:  # reported by wait()
            self._error = exc
        finally:
            if group is not None:
                torch.distributed.destroy_process_group(group)

    def wait(self) -> None:
        """Block until the last published version is fully broadcast; raise the sender's error if any. The
        rendezvous and each bucket have `timeout_s` each, and the sending thread fails on its own past them."""
        timeout_s = self.config.timeout_s * (1 + self._num_buckets)
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"broadcast transport: receivers did not take the weights within {timeout_s} s")
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"broadcast transport: sending failed: {error}") from error

    def close(self) -> None:
        self.wait()


class _GlooReceiver:
    """A receiving rank built directly on ProcessGroupGloo, on the store layout `join_group` produces.

    Not registered in torch.distributed's global registry, so a test can hold the sender (rank 0) and a
    receiver of the same group in one process.
    """

    def __init__(self, address: str, port: int, world_size: int, rank: int, group_name: str, timeout_s: float):
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        timeout = timedelta(seconds=timeout_s)
        store = TCPStore(address, port, world_size, is_master=False, timeout=timeout)
        # rendezvous store → PrefixStore(group_name) → torch's f"{group_name}/" → f"{device}/"
        store = PrefixStore("cpu/", PrefixStore(f"{group_name}/", PrefixStore(group_name, store)))
        self._group = ProcessGroupGloo(store, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        self._group.broadcast([tensor], options).wait()


class _Receiver:
    def __init__(self, g: Rendezvous, rank: int) -> None:
        if g.backend == "gloo":
            impl = _GlooReceiver(g.master_address, g.master_port, g.world_size, rank, g.group_name, g.timeout_s)
            self.broadcast = impl.broadcast
        else:
            pg = join_group(g.master_address, g.master_port, g.world_size, rank, g.group_name, g.backend, g.timeout_s)
            self.broadcast = lambda tensor: torch.distributed.broadcast(tensor, src=0, group=pg)


Sender = BroadcastSender


def read(handle: BroadcastHandle, rank: int = 1) -> Iterator[list[NamedTensor]]:
    """Join the handle's group as `rank` and receive every bucket in order (consume it to the end)."""
    g = handle.group
    receiver = _Receiver(g, rank)
    for layout in handle.layout:
        size = sum(torch.Size(shape).numel() * getattr(torch, dtype).itemsize for _, dtype, shape in layout)
        flat = torch.empty(size, dtype=torch.uint8, device="cuda" if g.backend == "nccl" else "cpu")
        receiver.broadcast(flat)
        yield unflatten(flat.cpu(), layout)


def receive(handle: BroadcastHandle, engine: LoadsTensors) -> None:
    """Servers that join the group themselves do (`JoinsGroup`); any other engine takes rank 1 and the tensors."""
    if isinstance(engine, JoinsGroup):
        engine.join_group(handle, lambda rank: read(handle, rank))
    else:
        engine.load_tensors(handle, read(handle))
