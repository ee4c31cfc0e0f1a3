"""broadcast: the trainer broadcasts each bucket over a torch.distributed group that the engines join.

Rank 0 is the sender (the trainer's rank 0); receivers take ranks 1..N (an SGLang server takes
`rank_offset + tp_rank`). The group is gloo on CPU and NCCL on GPU. It is created the way SGLang's
`/init_weights_update_group` creates its side (TCP rendezvous at `master_address:master_port`, a
store prefixed with the group name, `init_method` semantics of torch.distributed), so an SGLang
server and this module's own receiver join the same group.

`publish()` returns at once with a handle that names the group and lists every bucket's tensors
(name, dtype, shape); a background thread forms a fresh group for that version and broadcasts the
buckets in order, each as one flat byte tensor (SGLang's `flattened_bucket` load format), flattened inside
`publish` (the version's own copy, one copy of each byte). Receivers post/join with that handle; `wait()` blocks until
every bucket went out and raises what went wrong on the sender's side.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from miles_sync.config import BroadcastSync
from miles_sync.protocol import JoinsGroup, LoadsTensors
from miles_sync.transports.base import Transport
from miles_sync.transports.group import (
    GroupSender,
    aligned,
    dtype_name,
    gloo_group,
    group_name,
    join_group,
    nbytes,
    unflatten,
)
from miles_sync.types import BroadcastHandle, BucketLayout, NamedTensor, Rendezvous

NAME = "broadcast"


class BroadcastSender(GroupSender):
    """Rank 0 of a weight-update group with `receiver_ranks` receiving ranks."""

    name = NAME
    needs_receiver_ranks = True

    def __init__(self, config: BroadcastSync, receiver_ranks: int = 1) -> None:
        super().__init__(config, receiver_ranks)

    def _begin(self, weight_version: int) -> None:
        self.wait()  # one version at a time on the wire (at most timeout_s: receivers that never join fail here)
        self._flats = []
        self._layout: list[BucketLayout] = []

    def _put_bucket(self, index: int, bucket: list[NamedTensor]) -> None:
        bucket = self._keep_flat(bucket)
        layout = [(name, dtype_name(t.dtype), list(t.shape)) for name, t in bucket]
        assert aligned(layout)
        self._layout.append(layout)

    def _finish(self, common: dict) -> BroadcastHandle:
        # A fresh group per version: a receiver that was restarted since the last push simply joins the
        # next one (a gloo group cannot take a new member). Forming one costs ~10 ms on loopback.
        world_size = 1 + self.receiver_ranks
        self._store = store = self._listen(world_size)
        rendezvous = self._describe_group(store.port, group_name("miles-weights", common["weight_version"]), world_size)
        flats = self._flats
        self._start(self._send, len(flats), rendezvous, flats, store)
        return BroadcastHandle(**common, group=rendezvous, layout=self._layout)

    def _send(self, r: Rendezvous, flats: list[torch.Tensor], store: object) -> None:
        group = join_group(r, 0, store)
        try:
            while flats:
                flat = flats.pop(0)  # freed once sent
                if self.backend == "nccl":
                    flat = flat.cuda()
                torch.distributed.broadcast(flat, src=0, group=group)
        finally:
            torch.distributed.destroy_process_group(group)


class _Receiver:
    def __init__(self, g: Rendezvous, rank: int) -> None:
        if g.backend == "gloo":
            group = gloo_group(g, rank)

            def broadcast(tensor: torch.Tensor) -> None:
                options = torch.distributed.BroadcastOptions()
                options.rootRank = 0
                options.rootTensor = 0
                group.broadcast([tensor], options).wait()

            self.broadcast = broadcast
        else:
            pg = join_group(g, rank)
            self.broadcast = lambda tensor: torch.distributed.broadcast(tensor, src=0, group=pg)


def read(handle: BroadcastHandle, rank: int = 1) -> Iterator[list[NamedTensor]]:
    """Join the handle's group as `rank` and receive every bucket in order (consume it to the end)."""
    g = handle.group
    receiver = _Receiver(g, rank)
    for layout in handle.layout:
        size = sum(nbytes(dtype, shape) for _, dtype, shape in layout)
        flat = torch.empty(size, dtype=torch.uint8, device="cuda" if g.backend == "nccl" else "cpu")
        receiver.broadcast(flat)
        yield unflatten(flat.cpu(), layout)


def receive(handle: BroadcastHandle, engine: LoadsTensors) -> None:
    """Servers that join the group themselves do (`JoinsGroup`); any other engine takes rank 1 and the tensors."""
    if isinstance(engine, JoinsGroup):
        engine.join_group(handle, lambda rank: read(handle, rank))
    else:
        engine.load_tensors(handle, read(handle))


TRANSPORT = Transport(NAME, BroadcastSender, read, receive)
