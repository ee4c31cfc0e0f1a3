"""The trainer ranks' process group: joined once per process, torn down so that no rank outlives the
rendezvous store another still talks to; and the vocabulary padding tensor-parallel layouts share."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist


class DistributedGroup:
    """The default process group of this process: NCCL on GPU, gloo on CPU.

    On GPU the rank's device is chosen first: `LOCAL_RANK` when the launcher sets it, else the rank modulo the
    visible devices (Ray gives each trainer actor its own GPU, so that is 0). For a `tcp://host:port` address
    the rendezvous store is made here and kept, so that `close` can hold rank 0 (which hosts the store) until
    every rank has torn its group down. A process whose default group exists already joins nothing (`owned`
    is then False and `close` leaves the group alone)."""

    def __init__(self, rank: int, world_size: int, init_method: str | None) -> None:
        self.rank, self.world_size = rank, world_size
        self.store: Any = None
        self.owned = not dist.is_initialized()
        if not self.owned:
            return
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
            torch.cuda.set_device(local)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        address = urlparse(init_method or "tcp://127.0.0.1:29512")
        if address.scheme == "tcp" and address.hostname and address.port:
            self.store = dist.TCPStore(
                address.hostname, address.port, world_size, is_master=rank == 0, timeout=timedelta(seconds=300)
            )
            dist.init_process_group(backend, store=self.store, rank=rank, world_size=world_size)
        else:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)

    def close(self) -> None:
        """Tear the default group down on every rank. Rank 0 returns last: a rank whose group still talks to
        the store of a rank 0 that has exited aborts in gloo's teardown (seen in CI)."""
        if not self.owned or not dist.is_initialized():
            return
        dist.barrier()  # no rank tears its group down while a peer still talks to it
        dist.destroy_process_group()
        if self.store is not None:
            closed = self.store.add("miles/closed", 1)
            deadline = time.monotonic() + 30
            while self.rank == 0 and closed < self.world_size and time.monotonic() < deadline:
                time.sleep(0.01)
                closed = self.store.add("miles/closed", 0)
            self.store = None


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of the tensor-parallel size (vocab-parallel layers
    split it evenly); the extra rows are zeros and their logits are sliced off."""
    return -(-vocab_size // tp) * tp


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))], 0)
