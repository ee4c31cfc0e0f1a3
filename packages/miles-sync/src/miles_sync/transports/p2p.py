"""p2p: every trainer rank sends what it holds straight to each receiving rank; no gather on rank 0.

A trainer rank publishes the tensors it holds: whole tensors, or the row shards of tensors sharded along
dimension 0 (FSDP2's `Shard(0)` DTensors, which it reads itself; a replicated DTensor is sent by its first mesh
rank only). Each rank's `publish` returns a handle with its own part (`SenderPart`: its buckets' layouts and its
pieces' digests); `combine` merges the ranks' handles into the one the engines receive. A fresh group per version
holds the senders (ranks 0..S-1, rank 0 hosting the rendezvous store) and the receivers (ranks S..S+R-1); every
sender posts one point-to-point send per bucket and receiver at once (`isend`; the buckets are in flight
concurrently) and a receiver posts the matching receives, then puts the shards of each tensor together.

Each byte crosses once per receiver: a sender's bytes on the wire are its own pieces' bytes times the receivers
(`bytes_sent`, measured as handed to the send calls). The fingerprint hashes each piece under its key
(`piece_name`), and the handle's `pieces` lists the row ranges, so a receiver holding the whole tensors
computes the same fingerprint (`weight_fingerprint(..., pieces=handle.pieces)`).

The group is gloo on CPU (each rank builds its ProcessGroupGloo directly, so one process may hold several ranks,
as the tests do) and NCCL on GPU (`torch.distributed` point-to-point calls on a registered group; built, not run
on a GPU here). RDMA through Mooncake's Transfer Engine is not built: its package needs a GPU driver to import.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from miles_sync.config import P2PSync
from miles_sync.fingerprint import Fingerprinter, piece_name
from miles_sync.protocol import LoadsTensors
from miles_sync.transports.base import BucketedSender
from miles_sync.transports.broadcast import dtype_name, flatten, join_group
from miles_sync.types import NamedTensor, NamedTensors, P2PHandle, PieceLayout, Rendezvous, SenderPart

NAME = "p2p"


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _default_group() -> tuple[int, int]:
    """(rank, world size) of this process's torch.distributed world; (0, 1) outside one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def local_pieces(named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor, str, int, list[int]]]:
    """(key, the rows this rank holds, name, first row, full shape) per tensor this rank sends.

    A plain tensor is held whole. A DTensor on a one-dimensional mesh is read as FSDP2 lays it out: `Shard(0)`
    gives this rank's rows (none: nothing to send), `Replicate()` is sent by mesh rank 0 only."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for name, tensor in named_tensors:
        if not isinstance(tensor, DTensor):
            yield name, tensor, name, 0, list(tensor.shape)
            continue
        full = list(tensor.shape)
        placements = tuple(tensor.placements)
        if tensor.device_mesh.ndim != 1 or placements[0] not in (Shard(0), Replicate()):
            raise ValueError(
                f"p2p transport: {name} is laid out as {placements} on a {tensor.device_mesh.ndim}-D mesh; only "
                "row shards (Shard(0)) or replicas on a 1-D mesh can be sent as they are held"
            )
        if placements[0] == Replicate():
            if tensor.device_mesh.get_local_rank() == 0:
                yield name, tensor.to_local(), name, 0, full
            continue
        local = tensor.to_local()
        if local.shape[0] == 0:
            continue
        _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, placements)
        start = int(offset[0])
        whole = start == 0 and local.shape[0] == full[0]
        key = name if whole else piece_name(name, start, start + local.shape[0])
        yield key, local, name, start, full


class _Group:
    """One rank of a version's point-to-point group."""

    def __init__(self, r: Rendezvous, rank: int) -> None:
        self.backend = r.backend
        if r.backend == "gloo":
            from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

            timeout = timedelta(seconds=r.timeout_s)
            store = TCPStore(
                r.master_address, r.master_port, r.world_size, is_master=rank == 0, timeout=timeout,
                wait_for_workers=False,
            )  # fmt: skip
            self._store = store  # rank 0 serves the rendezvous as long as the group lives
            self._pg: Any = ProcessGroupGloo(PrefixStore(r.group_name, store), rank, r.world_size, timeout)
        else:
            self._pg = join_group(
                r.master_address, r.master_port, r.world_size, rank, r.group_name, r.backend, r.timeout_s
            )

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        if self.backend == "gloo":
            return self._pg.send([tensor], dst, tag)
        return torch.distributed.isend(tensor, dst, group=self._pg, tag=tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Any:
        if self.backend == "gloo":
            return self._pg.recv([tensor], src, tag)
        return torch.distributed.irecv(tensor, src, group=self._pg, tag=tag)

    def close(self) -> None:
        if self.backend != "gloo":
            torch.distributed.destroy_process_group(self._pg)


class P2PSender(BucketedSender):
    """One trainer rank's sender: `rank` of `num_senders` (the torch.distributed world's, by default)."""

    name = NAME
    from_every_rank = True

    def __init__(
        self, config: P2PSync, receiver_ranks: int = 1, rank: int | None = None, num_senders: int | None = None
    ) -> None:
        super().__init__(config, receiver_ranks)
        if receiver_ranks < 1:
            raise ValueError(f"p2p transport: receiver_ranks must be at least 1, got {receiver_ranks}")
        world_rank, world_size = _default_group()
        self.rank = world_rank if rank is None else rank
        self.num_senders = world_size if num_senders is None else num_senders
        self.backend = config.backend if config.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
        self.bytes_sent = 0  # of the last version, as handed to the send calls
        self._thread: threading.Thread | None = None
        self._num_buckets = 0
        self._error: BaseException | None = None

    def publish(self, named_tensors: NamedTensors, weight_version: int) -> P2PHandle:
        """Publish the tensors this rank holds (whole, or DTensor row shards); collective over the trainer ranks
        when they must agree on a port."""
        self._meta: dict[str, tuple[str, int, list[int]]] = {}

        def keyed() -> Iterator[NamedTensor]:
            for key, local, name, start, full in local_pieces(named_tensors):
                self._meta[key] = (name, start, full)
                yield key, local

        handle = super().publish(keyed(), weight_version)
        assert isinstance(handle, P2PHandle)
        return handle

    def _may_hold_nothing(self) -> bool:
        return self.num_senders > 1  # another rank may hold every tensor (a backend that gathers on rank 0)

    def _begin(self, weight_version: int) -> None:
        self.wait()  # one version at a time on the wire
        self._port = self._agree_on_port()
        self._flats: list[torch.Tensor] = []
        self._layout: list[PieceLayout] = []
        self._digests = Fingerprinter()

    def _agree_on_port(self) -> int:
        if self.config.master_port:
            return self.config.master_port
        port = _free_port(self.config.master_address) if self.rank == 0 else 0
        if self.num_senders > 1:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(
                    f"p2p transport: {self.num_senders} sender ranks must agree on a rendezvous port: set "
                    "sync.master_port, or publish from ranks of an initialized torch.distributed world"
                )
            box = [port]
            dist.broadcast_object_list(box, src=0)
            port = box[0]
        return port

    def _put_bucket(self, index: int, bucket: list[NamedTensor]) -> None:
        # Widest elements first, so each piece starts at a multiple of its element size in the flat bytes; the
        # flat bucket is the one copy of the bytes (the published version stays fixed while training goes on).
        bucket = sorted(bucket, key=lambda pair: -pair[1].element_size())
        layout = []
        for key, tensor in bucket:
            name, start, full = self._meta[key]
            layout.append((key, dtype_name(tensor.dtype), list(tensor.shape), name, start, full))
            self._digests.add(key, tensor)  # the same digest the base's fingerprint took
        self._flats.append(flatten(bucket))
        self._layout.append(layout)

    def _finish(self, common: dict) -> P2PHandle:
        rendezvous = Rendezvous(
            master_address=self.config.master_address,
            master_port=self._port,
            group_name=f"miles-p2p-{self._port}-v{common['weight_version']}",
            world_size=self.num_senders + self.receiver_ranks,
            backend=self.backend,
            timeout_s=self.config.timeout_s,
        )
        part = SenderPart(
            rank=self.rank, layout=self._layout, num_bytes=common["num_bytes"], digests=self._digests.digests
        )
        flats, self._error, self.bytes_sent = self._flats, None, 0
        self._num_buckets = len(flats)
        self._thread = threading.Thread(target=self._send, args=(rendezvous, flats), name="miles-p2p", daemon=True)
        self._thread.start()
        names = {entry[3] for bucket in self._layout for entry in bucket}
        common = {**common, "num_tensors": len(names), "pieces": _pieces([part])}
        return P2PHandle(**common, group=rendezvous, num_senders=self.num_senders, parts=[part])

    def _send(self, r: Rendezvous, flats: list[torch.Tensor]) -> None:
        group = None
        try:
            group = _Group(r, self.rank)
            if self.backend == "nccl":
                flats = [flat.cuda() for flat in flats]
            works = []
            for dst in range(self.num_senders, r.world_size):
                for tag, flat in enumerate(flats):
                    works.append(group.isend(flat, dst, tag))
                    self.bytes_sent += flat.numel()
            for work in works:
                work.wait()
        except BaseException as exc:  # reported by wait()
            self._error = exc
        finally:
            if group is not None:
                group.close()

    def wait(self) -> None:
        """Block until every receiver took this rank's buckets; raise the sending error if any."""
        timeout_s = self.config.timeout_s * (1 + self._num_buckets)
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"p2p transport: receivers did not take rank {self.rank}'s weights in {timeout_s} s")
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"p2p transport: rank {self.rank}: sending failed: {error}") from error

    def close(self) -> None:
        self.wait()


Sender = P2PSender


def _pieces(parts: list[SenderPart]) -> dict[str, list[tuple[int, int]]] | None:
    """Row ranges of the tensors that arrive in several pieces (or as a piece short of the whole)."""
    pieces: dict[str, list[tuple[int, int]]] = {}
    for part in parts:
        for bucket in part.layout:
            for key, _, shape, name, start, _ in bucket:
                if key != name:
                    pieces.setdefault(name, []).append((start, start + shape[0]))
    return {name: sorted(ranges) for name, ranges in pieces.items()} or None


def combine(handles: list[P2PHandle]) -> P2PHandle:
    """The handle of a whole version from every sender rank's own: their parts, the fingerprint of all pieces."""
    first = handles[0]
    ranks = sorted(h.parts[0].rank for h in handles)
    if ranks != list(range(first.num_senders)) or any(h.group != first.group for h in handles):
        raise ValueError(
            f"p2p transport: weight version {first.weight_version}: got the parts of ranks {ranks} of "
            f"{first.num_senders}, or parts of different groups; every sender rank publishes once per version"
        )
    parts = sorted((p for h in handles for p in h.parts if p.layout), key=lambda p: p.rank)
    if not parts:
        raise ValueError("publish() got no tensors on any rank: refusing to publish an empty weight version")
    digests: dict[str, bytes] = {}
    for part in parts:
        digests.update(part.digests)
    names = {entry[3] for part in parts for bucket in part.layout for entry in bucket}
    return P2PHandle(
        weight_version=first.weight_version,
        num_tensors=len(names),
        num_bytes=sum(p.num_bytes for p in parts),
        num_buckets=sum(len(p.layout) for p in parts),
        fingerprint=Fingerprinter.of_digests(digests).hexdigest(),
        dtype=first.dtype,
        packed=first.packed,
        pieces=_pieces(parts),
        group=first.group,
        num_senders=first.num_senders,
        parts=parts,
    )


def read(handle: P2PHandle, index: int = 0) -> Iterator[list[NamedTensor]]:
    """Join the group as receiver `index` (rank `num_senders + index`), take every sender's buckets (all receives
    posted at once) and yield, per bucket taken, the whole tensors it completed (shards put together)."""
    if any(p.rank >= handle.num_senders for p in handle.parts):
        raise ValueError(f"p2p handle for weight version {handle.weight_version} names a sender past its senders")
    group = _Group(handle.group, handle.num_senders + index)
    device = "cuda" if handle.group.backend == "nccl" else "cpu"
    try:
        pending = []
        for part in handle.parts:
            for tag, layout in enumerate(part.layout):
                size = sum(torch.Size(shape).numel() * getattr(torch, dtype).itemsize for _, dtype, shape, *_ in layout)
                flat = torch.empty(size, dtype=torch.uint8, device=device)
                pending.append((group.irecv(flat, part.rank, tag), flat, layout))
        partial: dict[str, tuple[torch.Tensor, int]] = {}  # a tensor being put together, rows still missing
        for work, flat, layout in pending:
            work.wait()
            flat, offset, done = flat.cpu(), 0, []
            for key, dtype, shape, name, start, full in layout:
                dt = getattr(torch, dtype)
                size = torch.Size(shape).numel() * dt.itemsize
                piece = flat[offset : offset + size].view(dt).reshape(shape)
                offset += size
                if key == name:
                    done.append((name, piece))
                    continue
                tensor, missing = partial.get(name) or (torch.empty(full, dtype=dt), full[0])
                tensor[start : start + shape[0]] = piece
                partial[name] = (tensor, missing - shape[0])
                if missing == shape[0]:
                    done.append((name, partial.pop(name)[0]))
            if done:
                yield done  # the tensors this bucket completed
        if partial:
            raise ValueError(f"p2p weight version {handle.weight_version}: rows of {sorted(partial)[:3]} never came")
    finally:
        group.close()


def receive(handle: P2PHandle, engine: LoadsTensors) -> None:
    """The engine's process is one receiving rank; it hands the whole tensors on to its servers."""
    engine.load_tensors(handle, read(handle))
