"""p2p: every trainer rank sends what it holds straight to each receiving rank; no gather on rank 0.

A trainer rank publishes the tensors it holds: whole tensors, or the row shards of tensors sharded along
dimension 0 (FSDP2's `Shard(0)` DTensors, which it reads itself; a replicated DTensor is sent by its first mesh
rank only). Each rank's `publish` returns a handle with its own part (`SenderPart`: its buckets' layouts and its
pieces' digests); `combine` merges the ranks' handles into the one the engines receive. A fresh group per version
holds the senders (ranks 0..S-1, rank 0 hosting the rendezvous store, opened inside `publish` and shared with the
other sender ranks in one collective) and the receivers (ranks S..S+R-1); every sender posts one point-to-point
send per bucket and receiver at once (`isend`; the buckets are in flight concurrently) and a receiver posts the
matching receives ahead, the senders' first buckets first and at most `max_buckets_in_flight` at a time (the
bytes it allocates stay bounded), then puts the shards of each tensor together.

Each byte crosses once per receiver: a sender's bytes on the wire are its own pieces' bytes times the receivers
(`bytes_sent`, measured as handed to the send calls). The fingerprint hashes each piece under its key
(`piece_name`), and the handle's `pieces` lists the row ranges, so a receiver holding the whole tensors
computes the same fingerprint (`weight_fingerprint(..., pieces=handle.pieces)`).

The group is gloo on CPU (each rank builds its ProcessGroupGloo directly, so one process may hold several ranks,
as the tests do) and NCCL on GPU (`torch.distributed` point-to-point calls on a registered group; built, not run
on a GPU here). RDMA through Mooncake's Transfer Engine is not built: its package needs a GPU driver to import.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from miles_sync.config import P2PSync
from miles_sync.fingerprint import Fingerprinter, piece_name
from miles_sync.protocol import LoadsTensors
from miles_sync.transports.base import Transport
from miles_sync.transports.group import (
    GroupSender,
    dtype_name,
    gloo_group,
    group_name,
    join_group,
    nbytes,
)
from miles_sync.types import NamedTensor, NamedTensors, P2PHandle, PieceLayout, Rendezvous, SenderPart

NAME = "p2p"


def _default_group() -> tuple[int, int]:
    """(rank, world size) of this process's torch.distributed world; (0, 1) outside one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def local_pieces(named_tensors: NamedTensors, rank: int = 0) -> Iterator[tuple[str, torch.Tensor, str, int, list[int]]]:
    """(key, the rows this rank holds, name, first row, full shape) per tensor sender `rank` sends.

    A plain tensor is held whole and sent by rank 0 only (a backend that gathers on rank 0 gives the other ranks
    nothing; one that gives every rank a copy holds it replicated). A DTensor on a one-dimensional mesh is read as FSDP2 lays it out: `Shard(0)`
    gives this rank's rows (none: nothing to send), `Replicate()` is sent by mesh rank 0 only."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for name, tensor in named_tensors:
        if not isinstance(tensor, DTensor):
            if rank == 0:
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
    """One rank of a version's point-to-point group (rank 0 passes the store it listens on)."""

    def __init__(self, r: Rendezvous, rank: int, store: Any = None) -> None:
        self.backend = r.backend
        self._pg = gloo_group(r, rank, store) if r.backend == "gloo" else join_group(r, rank, store)

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


class P2PSender(GroupSender):
    """One trainer rank's sender: `rank` of `num_senders` (the torch.distributed world's, by default)."""

    name = NAME
    from_every_rank = True
    config: P2PSync

    def __init__(
        self, config: P2PSync, receiver_ranks: int = 1, rank: int | None = None, num_senders: int | None = None
    ) -> None:
        super().__init__(config, receiver_ranks)
        world_rank, world_size = _default_group()
        self.rank = world_rank if rank is None else rank
        self.num_senders = world_size if num_senders is None else num_senders
        self.bytes_sent = 0  # of the last version, as handed to the send calls

    def publish(self, named_tensors: NamedTensors, weight_version: int) -> P2PHandle:
        """Publish the tensors this rank holds (whole, or DTensor row shards); collective over the trainer ranks
        when they must agree on the rendezvous."""
        self._meta: dict[str, tuple[str, int, list[int]]] = {}

        def keyed() -> Iterator[NamedTensor]:
            for key, local, name, start, full in local_pieces(named_tensors, self.rank):
                self._meta[key] = (name, start, full)
                yield key, local

        try:
            handle = super().publish(keyed(), weight_version)
        except BaseException:
            self._store = None  # no group forms for this version; the other ranks' sends time out
            raise
        assert isinstance(handle, P2PHandle)
        return handle

    def _may_hold_nothing(self) -> bool:
        return self.num_senders > 1  # another rank may hold every tensor (a backend that gathers on rank 0)

    def _who(self) -> str:
        return f"rank {self.rank}: "

    def _begin(self, weight_version: int) -> None:
        try:
            self.wait()  # one version at a time on the wire
            error: BaseException | None = None
        except Exception as exc:  # raised after the ranks met, so no rank waits for one that left
            error = exc
        self._rendezvous = self._agree(weight_version, error)
        self._flats = []
        self._layout: list[PieceLayout] = []

    def _agree(self, weight_version: int, error: BaseException | None) -> Rendezvous:
        """The version's rendezvous, chosen by rank 0 (which opens its store now). In a torch.distributed world rank
        0 shares it in one collective that also tells every rank whether any rank failed; outside one (a fixed
        `master_port`) every rank derives the same one from the config."""
        c = self.config
        import torch.distributed as dist

        in_world = self.num_senders > 1 and dist.is_available() and dist.is_initialized()
        if self.num_senders > 1 and not in_world and not c.master_port:
            error = error or ValueError(
                f"p2p transport: {self.num_senders} sender ranks must agree on a rendezvous: set sync.master_port, "
                "or publish from the ranks of an initialized torch.distributed world"
            )
        if self.rank == 0 and error is None:
            try:
                self._store = self._listen(self.num_senders + self.receiver_ranks)
            except Exception as exc:
                error = exc
        mine = None
        if error is None and (self.rank == 0 or not in_world):
            mine = self._describe_group(
                self._store.port if self.rank == 0 else c.master_port,
                (
                    group_name("miles-p2p", weight_version)  # rank 0 names it (alone, or shared in the world)
                    if in_world or self.num_senders == 1
                    else f"miles-p2p-{c.master_port}-v{weight_version}"  # the fixed port keeps versions apart
                ),
                self.num_senders + self.receiver_ranks,
            )
        if not in_world:
            if error is not None:
                raise error
            assert mine is not None
            return mine
        every: list[Any] = [None] * self.num_senders
        dist.all_gather_object(every, (mine, None if error is None else f"{type(error).__name__}: {error}"))
        if error is not None:
            self._store = None
            raise error
        failed = [(rank, why) for rank, (_, why) in enumerate(every) if why is not None]
        if failed:
            self._store = None
            rank, why = failed[0]
            raise RuntimeError(f"p2p transport: weight version {weight_version}: rank {rank} failed: {why}")
        return every[0][0]

    def _put_bucket(self, index: int, bucket: list[NamedTensor]) -> None:
        layout = []
        for key, tensor in self._keep_flat(bucket):
            name, start, full = self._meta[key]
            layout.append((key, dtype_name(tensor.dtype), list(tensor.shape), name, start, full))
        self._layout.append(layout)

    def _finish(self, common: dict) -> P2PHandle:
        rendezvous = self._rendezvous
        # p2p sends whole versions (no delta), so the base's digests are exactly this rank's pieces'.
        part = SenderPart(rank=self.rank, layout=self._layout, num_bytes=common["num_bytes"], digests=self._digests)
        flats, self.bytes_sent = self._flats, 0
        self._start(self._send, len(flats), rendezvous, flats, self._store)
        names = {entry[3] for bucket in self._layout for entry in bucket}
        common = {**common, "num_tensors": len(names), "pieces": _pieces([part])}
        return P2PHandle(
            **common,
            group=rendezvous,
            num_senders=self.num_senders,
            parts=[part],
            max_buckets_in_flight=self.config.max_buckets_in_flight,
        )

    def _send(self, r: Rendezvous, flats: list[torch.Tensor], store: Any) -> None:
        group = _Group(r, self.rank, store)
        try:
            if self.backend == "nccl":
                flats = [flat.cuda() for flat in flats]
            works = []
            for dst in range(self.num_senders, r.world_size):
                for tag, flat in enumerate(flats):
                    works.append(group.isend(flat, dst, tag))
                    self.bytes_sent += flat.numel()
            for work in works:
                work.wait()
        finally:
            group.close()


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
        max_buckets_in_flight=first.max_buckets_in_flight,
    )


def _in_turn(parts: list[SenderPart]) -> Iterator[tuple[int, int, PieceLayout]]:
    """(sender rank, tag, layout) of every bucket, the senders' first buckets first: each sender's buckets stay in
    the order it posts them (NCCL matches a pair's calls in order) and every sender is drained at once."""
    for tag in range(max((len(p.layout) for p in parts), default=0)):
        for part in parts:
            if tag < len(part.layout):
                yield part.rank, tag, part.layout[tag]


def read(handle: P2PHandle, index: int = 0) -> Iterator[list[NamedTensor]]:
    """Join the group as receiver `index` (rank `num_senders + index`), take every sender's buckets and yield, per
    bucket taken, the whole tensors it completed (shards put together). Receives are posted ahead, at most
    `max_buckets_in_flight` buckets at once, so the bytes allocated here stay bounded (on the GPU with NCCL)."""
    if any(p.rank >= handle.num_senders for p in handle.parts):
        raise ValueError(f"p2p handle for weight version {handle.weight_version} names a sender past its senders")
    group = _Group(handle.group, handle.num_senders + index)
    device = "cuda" if handle.group.backend == "nccl" else "cpu"
    try:
        todo = _in_turn(handle.parts)
        pending: deque[tuple[Any, torch.Tensor, PieceLayout]] = deque()

        def post() -> None:
            for rank, tag, layout in itertools.islice(todo, handle.max_buckets_in_flight - len(pending)):
                flat = torch.empty(
                    sum(nbytes(d, shape) for _, d, shape, *_ in layout), dtype=torch.uint8, device=device
                )
                pending.append((group.irecv(flat, rank, tag), flat, layout))

        partial: dict[str, tuple[torch.Tensor, int]] = {}  # a tensor being put together, rows still missing
        post()
        while pending:
            work, flat, layout = pending.popleft()
            work.wait()
            flat, offset, done = flat.cpu(), 0, []  # NCCL: off the GPU before the next receive is allocated
            del work
            post()  # the next bucket's receive goes out before this one is unpacked
            for key, dtype, shape, name, start, full in layout:
                dt = getattr(torch, dtype)
                size = nbytes(dtype, shape)
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


TRANSPORT = Transport(NAME, P2PSender, read, receive, combine=combine)
