"""Weights on the SGLang servers: loading a pushed version, the per-tensor checksum check against the published
HF tensors, and the copy of the current version kept for recovery.

The loader offers the transports' receivers (`miles_sync.receive`) three ways in, and never looks at which
transport a handle came from:
- `load_folder`: `/update_weights_from_disk` on a published folder;
- `load_tensors`: `/begin_weight_update` → `/update_weights_from_tensor` per bucket (shared-memory handles,
  CUDA IPC on GPU) → `/end_weight_update`, each bucket handed to the servers as it arrives (they load it while the
  transport delivers the next one);
- `join_group`: `/init_weights_update_group` on every server, then per bucket
  `/update_weights_from_distributed` while the trainer sends; this process joins the group too
  (rank 1) and receives a copy, which is what the check and recovery need (`group.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for

import httpx
import torch

from miles_rollout.engines.checks import check_names, check_push, held_fingerprint
from miles_rollout.engines.sglang.calls import ServerCalls, on_admitted, tp_size
from miles_rollout.engines.sglang.derived_layout import Recipe, derive_layout, expected_by_recipes, in_dtype
from miles_rollout.engines.sglang.group import group_ranks, receive_through_group
from miles_rollout.engines.sglang.layout import expected_checksums
from miles_rollout.engines.sglang.pause import PauseControl
from miles_rollout.engines.sglang.router import Router, Slot
from miles_rollout.engines.sglang.stream import BucketStream
from miles_rollout.engines.versions import WeightVersions
from miles_sync import BroadcastHandle, DiskHandle, NamedTensor, WeightHandle, receive, weight_fingerprint
from miles_sync.protocol import Buckets

HeldCopy = tuple[list[NamedTensor], str | None, dict | None]
"""A version as this process keeps it: its HF tensors, and the wire dtype and pieces of the push that brought it."""


class WeightMismatchError(RuntimeError):
    """An engine holds other weights than the ones published."""


class WeightLoader:
    """Loads versions into the admitted servers and checks them; `current` is the version they must hold. Taking a
    version records it in `versions` (the engine's; a loader of its own by default), with this process's copy of
    the one it replaces."""

    def __init__(
        self,
        name: str,
        slots: list[Slot],
        calls: ServerCalls,
        dtype_name: str,
        initial: list[NamedTensor],
        packed: str | None = None,
        versions: WeightVersions[HeldCopy] | None = None,
    ) -> None:
        self.name, self.slots, self.calls = name, slots, calls
        self.versions: WeightVersions[HeldCopy] = WeightVersions() if versions is None else versions
        self.packed = packed  # the format pushes must carry packed (the servers hold that layout), or None
        self.router: Router | None = None  # attach(): loading needs them, the start-up check does not
        self.pause: PauseControl | None = None
        self.dtype_name = dtype_name
        self.wire_dtype: str | None = None  # of the last push: the dtype the fingerprint names
        self.pieces: dict | None = None  # of the last push: the row ranges its senders held (several senders)
        self.held_version = 0  # what the servers hold before a load (a delta push must be based on it)
        self.servers_touched = False  # set by each load: whether a server was asked to load part of it
        self.timing: dict[str, float] = {}  # seconds in the parts of the last load (disk: read, servers, take)
        self._pinned: dict[int, list[str]] = {}  # per server that failed a load: shared files it may still map
        self.recipes: dict[str, Recipe] | None = None  # derive_from(): a layout learnt from a server, not the table
        self.set_current(initial)

    def attach(self, router: Router, pause: PauseControl) -> None:
        """The router (quarantine on a failed load) and the pause state (when a load may flush the cache)."""
        self.router, self.pause = router, pause

    def _parts(self) -> tuple[Router, PauseControl]:
        if self.router is None or self.pause is None:
            raise RuntimeError("sglang engine: weights loaded before the engine finished starting")
        return self.router, self.pause

    # ---- the current version --------------------------------------------------------------------

    def set_current(self, tensors: list[NamedTensor]) -> None:
        """The HF tensors every server must hold now and their fingerprint (checksums: on first use)."""
        self.current = tensors
        self.names = {name for name, _ in tensors}
        self._expected: dict[str, str] | None = None
        if self.packed is None:
            self.fingerprint = held_fingerprint(tensors, self.dtype_name, self.wire_dtype, self.pieces)
        else:  # held as received: fp8 values and fp32 scales as packed, the rest in the wire dtype (= held)
            self.fingerprint = weight_fingerprint(tensors, pieces=self.pieces)

    @property
    def expected(self) -> dict[str, str]:
        """Per-tensor checksums of the current weights in SGLang's layout (what /weights_checker reports)."""
        if self._expected is None:
            dtype = getattr(torch, self.dtype_name)
            if self.recipes is None:
                self._expected = expected_checksums(self.current, dtype)
            else:
                self._expected = expected_by_recipes(self.recipes, in_dtype(self.current, dtype))
        return self._expected

    def derive_from(self, slot: Slot) -> None:
        """Learn the layout from a server that holds the current (checkpoint) weights: its parameters' checksums
        against recipes over the HF tensors (derived_layout). For families the table in layout.py does not know."""
        ranks = self.calls.post(slot.url, "/weights_checker", {"action": "checksum"})["ranks"]
        self.recipes = derive_layout(in_dtype(self.current, getattr(torch, self.dtype_name)), ranks[0]["checksums"])
        self._expected = None

    def _accept(self, handle: WeightHandle, tensors: list[NamedTensor]) -> None:
        """Take `tensors` (all of a version, or a delta push's changed ones) as the current version."""
        self._take(handle, self._checked(handle, tensors))

    def _checked(self, handle: WeightHandle, tensors: list[NamedTensor]) -> list[NamedTensor]:
        """The whole version `tensors` make (a delta push's changed ones over the current version), or ValueError
        naming what the engine refuses. Changes nothing: the current version stays until `_take`."""
        self._check_packed(handle)
        check_push(self.name, handle, {name for name, _ in tensors}, self.names, self.held_version)
        if handle.base_version is not None:  # the rest of the version is what the servers already hold
            changed = dict(tensors)
            tensors = [(name, changed.get(name, tensor)) for name, tensor in self.current]
        return tensors

    def _refuse_early(self, handle: WeightHandle, names: set[str]) -> None:
        """What one bucket shows before any server loads it: the wrong packed layout, a delta on a version the
        servers do not hold, tensors the model does not have (a missing one shows at the end: `_checked`)."""
        self._check_packed(handle)
        if handle.base_version is not None:
            check_push(self.name, handle, names, self.names, self.held_version)
            return
        check_names(self.name, handle.weight_version, names, names & self.names)

    def _check_packed(self, handle: WeightHandle) -> None:
        if handle.packed != self.packed:
            held = f"packed {self.packed} weights" if self.packed else "plain-value weights"
            sent = f"packed {handle.packed} weights" if handle.packed else "plain-value weights"
            raise ValueError(
                f"{self.name} engine: weight version {handle.weight_version} carries {sent} but the servers hold "
                f"{held}: sync.quant_wire must be the same for the engine and every push"
            )

    def _take(self, handle: WeightHandle, tensors: list[NamedTensor]) -> None:
        # the copy it replaces: for roll_back(), and for taking it back when the check after the load fails
        self.versions.took(handle.weight_version, (self.current, self.wire_dtype, self.pieces))
        self.wire_dtype, self.pieces = handle.dtype, handle.pieces
        self.set_current(tensors)

    def reinstate(self, copy: HeldCopy) -> None:
        """A replaced version becomes the current one again (the servers are then `restore`d to it)."""
        tensors, self.wire_dtype, self.pieces = copy
        self.set_current(tensors)

    def verify(self, slot: Slot, version: int) -> None:
        """The server must report exactly the checksums of the weights last published."""
        ranks = self.calls.post(slot.url, "/weights_checker", {"action": "checksum"})["ranks"]
        expected = self.expected
        for rank in ranks:
            actual = rank["checksums"]
            differ = sorted(n for n in expected if actual.get(n) != expected[n])
            extra = sorted(set(actual) - set(expected))
            if differ or extra:
                raise WeightMismatchError(
                    f"sglang engine {slot.url}: {len(differ)} tensors differ from weight version "
                    f"{version} (e.g. {differ[:3]}); unexpected tensors {extra[:3]}"
                )

    # ---- loading a pushed version ---------------------------------------------------------------

    def load(self, handle: WeightHandle, held_version: int) -> None:
        """Load the pushed version into every admitted server (quarantining those the transport fails); the
        servers hold `held_version` now (a delta push must be based on it). The handle's transport decides,
        through the capabilities below: `load_folder` (the servers read the folder), `join_group` (the servers
        join the collective group) or `load_tensors` (this process hands them its tensors in shared memory)."""
        self.held_version = held_version
        self.servers_touched = False  # True once a server was asked to load part of this version
        receive(handle, self)

    def restore(self, version: int, check: bool) -> list[Slot]:
        """After a push that failed once servers had (part of) it: load the current version (the one before the
        push: a failed load leaves it, or takes it back) into every admitted server from this process's copy, one
        copy in shared memory for all of them, and verify it when `check`. A server that cannot is quarantined
        (the router's recovery loads it before it serves again). Returns the servers restored."""
        from miles_sync.shared import into_shared, shm_file, use_file_system_sharing

        router = self._parts()[0]
        admitted = [s for s in self.slots if s.admitted]
        use_file_system_sharing()
        shared = [(name, into_shared(tensor)) for name, tensor in self.current]
        files = [f for _, t in shared if (f := shm_file(t))]
        outcome: dict[int, bool] = {}

        def one(slot: Slot) -> None:
            self._tracked(slot, outcome, lambda: self.load_buckets(slot, [shared], version))
            if check:
                self.verify(slot, version)

        try:
            with ThreadPoolExecutor(max_workers=max(1, len(admitted))) as pool:
                futures = {slot: pool.submit(one, slot) for slot in admitted}
        finally:
            self._release([shared], files, outcome)
        restored = []
        for slot, future in futures.items():
            if (exc := future.exception()) is None:
                restored.append(slot)
            else:
                router.quarantine(slot, f"rolling back to weight version {version} failed: {type(exc).__name__}")
        return restored

    def load_folder(self, handle: DiskHandle, buckets: Buckets) -> None:
        """`/update_weights_from_disk` on the published folder; this process reads it for the check."""
        began = time.perf_counter()
        tensors = self._checked(handle, [pair for bucket in buckets for pair in bucket])
        self.timing = {"read": time.perf_counter() - began}
        body = {
            "model_path": handle.location,
            "weight_version": str(handle.weight_version),
            "keep_pause": True,  # a paused server stays paused until resume()
        }

        def load(slot: Slot) -> None:
            self.calls.post(slot.url, "/update_weights_from_disk", {**body, **self._parts()[1].cache_flush_flag(slot)})

        self.servers_touched = True
        began = time.perf_counter()
        on_admitted(self.slots, self._parts()[0], load, "disk update")
        self.timing["servers"] = time.perf_counter() - began
        began = time.perf_counter()
        self._take(handle, tensors)
        self.timing["take"] = time.perf_counter() - began

    def load_tensors(self, handle: WeightHandle, buckets: Buckets) -> None:
        """Hand the tensors to every server as shared-memory handles, bucket by bucket as the transport delivers
        them: tensors already in shared memory (mapped from a `tensor` push) as they are, others through one copy
        into shared memory, freed after the load. The servers load a bucket while the next one arrives (and this
        process copies what it keeps); a bucket the model cannot take is refused before any server sees it (before
        any server is touched when it is the first, as is a whole version whose number of tensors is not the
        model's), and a version found wrong later fails before its last bucket reaches the servers, after which
        the engine rolls them back (`servers_touched`)."""
        from miles_sync.shared import into_shared, shm_file, use_file_system_sharing

        use_file_system_sharing()
        router = self._parts()[0]
        if handle.base_version is None and handle.pieces is None and handle.num_tensors != len(self.names):
            # A whole version of another size than the model's cannot load: read it all to name what it lacks or
            # adds, before any server is touched (row shards, `pieces`, count once per piece).
            whole = [pair for bucket in buckets for pair in bucket]
            self._checked(handle, whole)
            buckets = iter([whole])
        stream = BucketStream()
        kept: list[NamedTensor] = []  # this process's copy of the version, for the check and recovery
        copies: list[str] = []  # files of our own copies into shared memory
        outcome: dict[int, bool] = {}
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-load")
        loading = None

        def load(slot: Slot) -> None:
            self._tracked(slot, outcome, lambda: self.load_buckets(slot, stream, handle.weight_version))

        try:
            try:
                for bucket in buckets:
                    self._refuse_early(handle, {name for name, _ in bucket})
                    shared = [(n, t if t.is_shared() else into_shared(t)) for n, t in bucket]
                    copies += [
                        f for (_, s), (_, t) in zip(shared, bucket, strict=True) if s is not t and (f := shm_file(s))
                    ]
                    stream.put(shared)
                    if loading is None:
                        self.servers_touched = True
                        loading = pool.submit(on_admitted, self.slots, router, load, "tensor update")
                    # The version kept here must outlive the sender's shared memory: mapped tensors are copied.
                    kept += [(n, t.clone() if t.is_shared() else t) for n, t in bucket]
                tensors = self._checked(handle, kept)  # before the last bucket (it carries the version) goes on
            except BaseException:
                stream.close(failed=True)
                raise
            stream.close()
            if loading is not None:
                loading.result()
            self._take(handle, tensors)
        finally:
            if loading is not None:
                wait_for([loading])  # the servers' loads end (a broken stream stops them) before their files go
            pool.shutdown()
            self._release(stream.buckets, copies, outcome)

    def _tracked(self, slot: Slot, outcome: dict[int, bool], load: Callable[[], None]) -> None:
        """Run a server's load, noting whether it answered (`outcome[index]`: True when it loaded, False when the
        call broke off without an answer: a timeout or a reset, after which the server may still read the load's
        shared files)."""
        try:
            load()
        except httpx.TransportError:
            outcome[slot.index] = False
            raise
        outcome[slot.index] = True

    def _release(self, shared: list[list[NamedTensor]], files: list[str], outcome: dict[int, bool]) -> None:
        """Drop our references to a load's shared tensors and unlink the files of our copies, unless a server's
        call broke off without an answer: it may still map them (or read a payload later), and torch aborts a
        process whose shared file vanished under it. Those files stay until that server has answered a later load
        (weight updates run one at a time in a server) or its process is gone (`server_gone`, `release_pinned`)."""
        from miles_sync.shared import release_files

        for index, loaded in outcome.items():
            if loaded:
                self._unpin(index)  # its earlier loads are over
        unanswered = [s for s in self.slots if outcome.get(s.index) is False]
        if not unanswered:
            release_files(shared, files)  # our references go first, then the files of our copies
            return
        release_files(shared, [])
        for slot in unanswered:
            self._pinned.setdefault(slot.index, []).extend(files)
            slot.note(f"keeps {len(files)} shared-memory files of a load it did not answer until it answers again")

    def _unpin(self, index: int) -> None:
        from miles_sync.shared import release_files

        files = self._pinned.pop(index, [])
        held = {f for other in self._pinned.values() for f in other}  # another server may hold them too
        release_files([], [f for f in files if f not in held])

    def server_gone(self, slot: Slot) -> None:
        """`slot`'s server process is gone (restarted or stopped): unlink the shared files it might have held."""
        self._unpin(slot.index)

    def release_pinned(self) -> None:
        """Every server this engine launched stopped: unlink what unanswered loads left (`_release`). Files pinned
        for a server attached by URL stay: it may still run."""
        for slot in self.slots:
            if slot.server is not None:
                self.server_gone(slot)

    def load_buckets(self, slot: Slot, buckets: Iterable[list[NamedTensor]], version: int) -> None:
        """`/update_weights_from_tensor` per bucket, inside `/begin_weight_update` … `/end_weight_update`. A bucket
        is sent once the next one is there or `buckets` ended (the last one carries the version)."""
        from miles_sync.shared import serialize_bucket, use_file_system_sharing

        use_file_system_sharing()
        self.calls.post(slot.url, "/begin_weight_update")
        try:
            ahead = iter(buckets)
            following = next(ahead, None)
            while following is not None:
                bucket, following = following, next(ahead, None)
                last = following is None
                payloads = [serialize_bucket(bucket) for _ in range(tp_size(slot))]
                body = {"serialized_named_tensors": payloads, **self._parts()[1].cache_flush_flag(slot, last)}
                if last:
                    body["weight_version"] = str(version)
                self.calls.post(slot.url, "/update_weights_from_tensor", body)
        finally:
            self.calls.post(slot.url, "/end_weight_update")

    def load_current(self, slot: Slot, version: int) -> None:
        """Push the current version from this process's copy, through shared memory (recovery)."""
        from miles_sync.shared import into_shared, shm_file, use_file_system_sharing

        use_file_system_sharing()
        shared = [(name, into_shared(tensor)) for name, tensor in self.current]
        files = [f for _, t in shared if (f := shm_file(t))]
        outcome: dict[int, bool] = {}
        try:
            self._tracked(slot, outcome, lambda: self.load_buckets(slot, [shared], version))
        finally:
            self._release([shared], files, outcome)

    def receiver_ranks(self) -> int:
        """Ranks this engine takes in a collective weight group: itself (the verifier) and every server rank."""
        return group_ranks(self.slots)[1] - 1

    def join_group(self, handle: BroadcastHandle, receive_as: Callable[[int], Buckets]) -> None:
        """Every server joins the handle's group; this process joins as rank 1 and keeps a copy (`group.py`). A
        version the engine refuses, or a group of the wrong size, is refused before any server is touched."""
        published = {n for bucket in handle.layout for n, _, _ in bucket}
        check_push(self.name, handle, published, self.names, self.held_version)
        offsets, num_ranks = group_ranks(self.slots)
        if handle.group.world_size != num_ranks:
            raise ValueError(
                f"sglang engine: the weight group has {handle.group.world_size} ranks but the trainer, this engine "
                f"and its servers need {num_ranks}; build the sender with receiver_ranks={num_ranks - 1}"
            )
        self.servers_touched = True
        received = receive_through_group(self.calls, self.slots, self._parts()[1], handle, receive_as, offsets)
        self._accept(handle, received)
