"""The SGLang engine's weight loader without servers: what it does with a load's shared memory when a server
fails the load (the servers' side of loading is covered by the engine contract suite)."""

from pathlib import Path

import httpx
import pytest
import torch


class QuarantineOnly:
    """The one router call a load makes when a server fails it (the real router needs live servers)."""

    def quarantine(self, slot, reason: str) -> None:
        slot.admitted, slot.reason = False, reason


def test_a_server_that_did_not_answer_a_load_keeps_its_shared_files_until_it_answers_again_or_is_gone():
    """A server whose load timed out may still read the load's shared-memory files (and torch aborts a process
    whose file vanished under it): those files stay until that server answers a later load or its process is
    gone. A server that answered with an error, and every load all servers took, leave nothing behind."""
    from miles_rollout.engines.sglang.router import Slot
    from miles_rollout.engines.sglang.weights import WeightLoader
    from miles_sync import InprocHandle
    from miles_sync.shared import deserialize_bucket, serialize_bucket, shm_file

    initial = [("a", torch.zeros(4)), ("b", torch.ones(2, 3))]
    slots = [Slot(index=0, url="http://good"), Slot(index=1, url="http://slow")]
    loader = WeightLoader("sglang", slots, None, "float32", initial)  # type: ignore[arg-type]
    loader.attach(QuarantineOnly(), object())  # type: ignore[arg-type]
    seen: list[str] = []
    behaviour = {"http://good": "load", "http://slow": "time out"}

    def load_buckets(slot, buckets, version) -> None:
        """What the real one hands a server: payloads (each pins its files until unpickled); a server that loads
        reads them, one that times out never answers, one that fails answers without reading them."""
        seen.extend(f for bucket in buckets for _, t in bucket if (f := shm_file(t)))
        payloads = [serialize_bucket(bucket) for bucket in buckets]
        if behaviour[slot.url] == "time out":
            raise httpx.ReadTimeout("timed out")
        if behaviour[slot.url] == "fail":
            raise RuntimeError("the server answered 500")
        for payload in payloads:
            deserialize_bucket(payload)

    loader.load_buckets = load_buckets  # type: ignore[method-assign]

    def push(version: int) -> list[str]:
        seen.clear()
        weights = [(n, t + version) for n, t in initial]
        handle = InprocHandle(
            weight_version=version, num_tensors=2, num_bytes=40, num_buckets=1, fingerprint="f", buckets=[weights]
        )
        loader.load_tensors(handle, [weights])
        return sorted(set(seen))

    def on_shm(files: list[str]) -> list[bool]:
        return [(Path("/dev/shm") / f.lstrip("/")).exists() for f in files]

    first = push(1)
    assert len(first) == 2 and not slots[1].admitted and slots[0].admitted
    assert on_shm(first) == [True, True]  # the slow server may still map them
    assert "keeps 2 shared-memory files" in slots[1].events[-1]
    loader.server_gone(slots[1])  # restarted: its process is gone
    assert on_shm(first) == [False, False]
    second = push(2)  # the slow one is quarantined: only the good one loads, and takes it
    assert len(second) == 2 and on_shm(second) == [False, False]
    # recovery of a live server: a timed-out load_current pins its copy; one it answers frees that too
    seen.clear()
    with pytest.raises(httpx.ReadTimeout):
        loader.load_current(slots[1], 2)
    pinned = sorted(set(seen))
    assert len(pinned) == 2 and on_shm(pinned) == [True, True]
    behaviour["http://slow"] = "fail"
    seen.clear()
    with pytest.raises(RuntimeError, match="answered 500"):
        loader.load_current(slots[1], 2)
    assert len(set(seen)) == 2 and on_shm(sorted(set(seen))) == [False, False]  # answered: none of it kept
    assert on_shm(pinned) == [True, True]  # an error answer is not a load: the earlier files stay
    behaviour["http://slow"] = "load"
    loader.load_current(slots[1], 2)
    assert on_shm(pinned) == [False, False] and not loader._pinned  # it answered a later load: all freed
