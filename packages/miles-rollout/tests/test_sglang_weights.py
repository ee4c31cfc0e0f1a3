"""The SGLang engine's weight loader without servers: what it does with a load's shared memory when a server
fails the load (the servers' side of loading is covered by the engine contract suite)."""

from pathlib import Path

import httpx
import torch


class QuarantineOnly:
    """The one router call a load makes when a server fails it (the real router needs live servers)."""

    def quarantine(self, slot, reason: str) -> None:
        slot.admitted, slot.reason = False, reason


def test_a_server_that_failed_a_load_keeps_its_shared_files_until_its_process_is_gone():
    """A server whose load timed out may still read the load's shared-memory files (and torch aborts a process
    whose file vanished under it): those files stay until that server is restarted or stopped; after a load
    every server took, they go at once."""
    from miles_rollout.engines.sglang.router import Slot
    from miles_rollout.engines.sglang.weights import WeightLoader
    from miles_sync import InprocHandle
    from miles_sync.shared import deserialize_bucket, serialize_bucket, shm_file

    initial = [("a", torch.zeros(4)), ("b", torch.ones(2, 3))]
    slots = [Slot(index=0, url="http://good"), Slot(index=1, url="http://slow")]
    loader = WeightLoader("sglang", slots, None, "float32", initial)  # type: ignore[arg-type]
    loader.attach(QuarantineOnly(), object())  # type: ignore[arg-type]
    seen: list[str] = []

    def load_buckets(slot, buckets, version) -> None:
        """What the real one hands a server: payloads (each pins its files until unpickled); the good server
        reads them, the slow one never answers."""
        seen.extend(f for bucket in buckets for _, t in bucket if (f := shm_file(t)))
        payloads = [serialize_bucket(bucket) for bucket in buckets]
        if slot.url == "http://slow":
            raise httpx.ReadTimeout("timed out")
        for payload in payloads:
            deserialize_bucket(payload)

    loader.load_buckets = load_buckets  # type: ignore[method-assign]

    def push(version: int) -> list[str]:
        seen.clear()
        weights = [(n, t + version) for n, t in initial]
        loader.load_tensors(
            InprocHandle(
                weight_version=version, num_tensors=2, num_bytes=40, num_buckets=1, fingerprint="f", buckets=[weights]
            ),
            [weights],
        )
        return sorted(set(seen))

    def on_shm(files: list[str]) -> list[bool]:
        return [(Path("/dev/shm") / f.lstrip("/")).exists() for f in files]

    files = push(1)
    assert len(files) == 2 and not slots[1].admitted and slots[0].admitted
    assert on_shm(files) == [True, True]  # the slow server may still map them
    assert "keeps 2 shared-memory files" in slots[1].events[-1]
    loader.server_gone(slots[1])
    assert on_shm(files) == [False, False]
    files = push(2)  # only the admitted server loads now, and takes it
    assert len(files) == 2 and on_shm(files) == [False, False]
