"""Contract suite for every transport: publish → read back is bit-exact, bucketed, versioned."""

import gc
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from miles_sync import TRANSPORTS, BroadcastSync, DiskSync, build_sender, read_buckets, sync_config, weight_fingerprint


def sample_weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(16, 8, generator=g)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8, generator=g)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(8, generator=g)),
        ("model.norm.weight", torch.randn(8, generator=g).to(torch.bfloat16)),
        ("step_counter", torch.tensor(7, dtype=torch.int64)),
        ("lm_head.weight", torch.randn(16, 8, generator=g)),
    ]


def read_all(handle) -> dict[str, torch.Tensor]:
    out = {}
    for bucket in read_buckets(handle):
        for name, tensor in bucket:
            assert name not in out, f"{name} delivered twice"
            out[name] = tensor
    return out


class Collector:
    """The least an engine offers the receivers: tensors read in its own process (`LoadsTensors`)."""

    name = "collector"

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.tensors: dict[str, torch.Tensor] = {}

    def load_tensors(self, handle, buckets) -> None:
        self.calls.append("load_tensors")
        self.tensors = {name: tensor.clone() for bucket in buckets for name, tensor in bucket}


class ServerEngine(Collector):
    """An engine whose servers read folders and join groups themselves (what SGLang's loader offers)."""

    def load_folder(self, handle, buckets) -> None:
        self.calls.append("load_folder")
        self.folder = handle.location
        self.tensors = {name: tensor for bucket in buckets for name, tensor in bucket}

    def receiver_ranks(self) -> int:
        return 1

    def join_group(self, handle, receive_as) -> None:
        self.calls.append("join_group")
        self.tensors = {name: tensor for bucket in receive_as(1) for name, tensor in bucket}


UNPIPELINED = "tensor-unpipelined"
"""The `tensor` transport without `sync.pipeline` (every copy ends inside `publish`; `tensor` itself hands the
version out before its copies end): it passes the same contract suite."""


@pytest.fixture(params=[*TRANSPORTS, UNPIPELINED])
def transport(request):
    return request.param


def make_sender(transport: str, tmp_path, **kwargs):
    if transport == UNPIPELINED:
        transport, kwargs["pipeline"] = "tensor", False
    if transport == "disk":
        kwargs.setdefault("dir", str(tmp_path / "w"))
    return build_sender(sync_config(transport=transport, **kwargs))


def test_round_trip_is_bit_exact(transport, tmp_path):
    weights = sample_weights()
    sender = make_sender(transport, tmp_path)
    handle = sender.publish(iter(weights), weight_version=3)
    got = read_all(handle)
    assert set(got) == {n for n, _ in weights}
    for name, tensor in weights:
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(got[name].view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
    assert handle.weight_version == 3
    assert handle.num_tensors == len(weights)
    assert handle.num_bytes == sum(t.numel() * t.element_size() for _, t in weights)
    assert handle.fingerprint == weight_fingerprint(weights) == weight_fingerprint(got.items())


def test_small_buckets_split_but_never_split_a_tensor(transport, tmp_path):
    weights = sample_weights()
    sender = make_sender(transport, tmp_path, bucket_bytes=300)  # smaller than the 512-byte embeddings
    handle = sender.publish(weights, weight_version=1)
    buckets = list(read_buckets(handle))  # read once: a broadcast is received once per rank
    assert handle.num_buckets == len(buckets) > 1
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= 300 or len(bucket) == 1
    assert {n for bucket in buckets for n, _ in bucket} == {n for n, _ in weights}


def test_wire_dtype_casts_floats_only(transport, tmp_path):
    weights = sample_weights()
    handle = make_sender(transport, tmp_path, dtype="bfloat16").publish(weights, weight_version=1)
    got = read_all(handle)
    assert got["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(got["lm_head.weight"], dict(weights)["lm_head.weight"].to(torch.bfloat16))
    assert got["step_counter"].dtype == torch.int64
    assert handle.fingerprint == weight_fingerprint(weights, dtype=torch.bfloat16)
    assert handle.dtype == "bfloat16"  # receivers compare in the dtype that was sent
    assert make_sender(transport, tmp_path / "b").publish(weights, weight_version=2).dtype is None


def test_published_version_is_immutable(transport, tmp_path):
    weights = sample_weights()
    sender = make_sender(transport, tmp_path)
    handle = sender.publish(weights, weight_version=1)
    if transport == "tensor":
        sender.wait()  # it copies until then (sync.pipeline): the runtime waits before the next train step
    weights[0][1].add_(1.0)  # the trainer keeps training after publishing
    got = read_all(handle)
    assert got["model.embed_tokens.weight"].sum() != weights[0][1].sum()
    assert weight_fingerprint(got.items()) == handle.fingerprint


def test_empty_publish_is_refused(transport, tmp_path):
    with pytest.raises(ValueError, match="no tensors"):
        make_sender(transport, tmp_path).publish([], weight_version=1)


def test_disk_keeps_only_recent_versions(tmp_path):
    sender = make_sender("disk", tmp_path, keep_versions=2)
    handles = [sender.publish(sample_weights(), weight_version=v) for v in (1, 2, 3)]
    kept = sorted(p.name for p in (tmp_path / "w").iterdir())
    assert kept == ["v00000002", "v00000003"]
    with pytest.raises(FileNotFoundError, match="weight version 1"):
        list(read_buckets(handles[0]))
    assert read_all(handles[2]).keys() == {n for n, _ in sample_weights()}


def test_unknown_transport_in_handle(tmp_path):
    handle = make_sender("inproc", tmp_path).publish(sample_weights(), weight_version=1)
    import dataclasses

    from miles_sync import receive

    forged = dataclasses.replace(handle, transport="carrier-pigeon")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'"):
        read_buckets(forged)
    with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'"):
        receive(forged, Collector())


def test_disk_prunes_only_its_own_versions(tmp_path):
    other = make_sender("disk", tmp_path)
    foreign = other.publish(sample_weights(), weight_version=900)  # another run sharing the folder
    mine = make_sender("disk", tmp_path, keep_versions=1)
    mine.publish(sample_weights(), weight_version=1)
    latest = mine.publish(sample_weights(), weight_version=2)
    assert read_all(foreign).keys() == read_all(latest).keys()
    assert not (tmp_path / "w" / "v00000001").exists()


READ_IN_CHILD = """
import pickle, sys
from miles_sync import read_buckets, weight_fingerprint
from miles_sync.transports import broadcast
handle = pickle.loads(sys.stdin.buffer.read())
buckets = broadcast.read(handle, int(sys.argv[1])) if handle.transport == "broadcast" else read_buckets(handle)
print(weight_fingerprint([p for bucket in buckets for p in bucket]))
"""


def read_in_subprocess(handle, rank: int = 1, stderr=None) -> subprocess.Popen:
    payload = tempfile.NamedTemporaryFile(suffix=".pkl", delete=False)
    payload.write(pickle.dumps(handle))
    payload.close()
    return subprocess.Popen(
        [sys.executable, "-c", READ_IN_CHILD, str(rank)],
        stdin=open(payload.name, "rb"),
        stdout=subprocess.PIPE,
        stderr=stderr,
    )


@pytest.mark.parametrize("transport", ["tensor", UNPIPELINED, "broadcast"])
def test_another_process_receives_the_exact_weights(transport, tmp_path):
    weights = sample_weights()
    sender = make_sender(transport, tmp_path, bucket_bytes=300)
    try:
        handle = sender.publish(weights, weight_version=4)
        child = read_in_subprocess(handle)
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0
        assert out.decode().strip() == handle.fingerprint == weight_fingerprint(weights)
    finally:
        sender.close()


def shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"torch_{os.getpid()}_*")}


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_tensor_transport_keeps_recent_versions_and_frees_shared_memory(tmp_path):
    before = shm_files()
    sender = make_sender("tensor", tmp_path, keep_versions=1)
    first = sender.publish(sample_weights(), weight_version=1)
    assert shm_files() - before, "the published buckets live in /dev/shm"
    files = shm_files() - before
    moved = [(n, t + 1 if t.is_floating_point() else t) for n, t in sample_weights()]
    second = sender.publish(moved, weight_version=2)
    assert shm_files() - before == files, "a version reuses the shared memory of the one it replaces"
    with pytest.raises(FileNotFoundError, match="weight version 1: its shared memory now holds version 2"):
        list(read_buckets(first))  # its slot was reused: only the last version is kept
    got = read_all(second)
    for name, tensor in moved:
        assert torch.equal(got[name], tensor), name
    del got  # what this process mapped must go before its memory is released (as for any released version)
    again = sender.publish(moved, weight_version=2)  # the same number again (a push after a roll-back)
    with pytest.raises(FileNotFoundError, match="weight version 2: its shared memory now holds version 2"):
        list(read_buckets(second))  # the stamp tells publishes apart, not only version numbers
    assert read_all(again).keys() == {n for n, _ in moved}
    bigger = sample_weights() + [("extra", torch.randn(300))]
    assert read_all(sender.publish(bigger, weight_version=3)).keys() == {n for n, _ in bigger}
    sender.close()
    gc.collect()
    assert shm_files() <= before, "close() must release every shared-memory file"


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_tensor_payloads_read_by_two_processes_do_not_break_later_versions(tmp_path):
    """Two readers of one payload (SGLang's data-parallel replicas) unpickle it twice, and torch's count in the
    shared file then reaches zero early: a reader unlinks it. The next versions in that slot must still arrive."""
    sender = make_sender("tensor", tmp_path, keep_versions=1)
    try:
        for version in (1, 2, 3):
            handle = sender.publish(sample_weights(), weight_version=version)
            for _ in range(2):
                child = read_in_subprocess(handle)
                out, _ = child.communicate(timeout=120)
                assert child.returncode == 0, f"version {version}"
                assert out.decode().strip() == handle.fingerprint
    finally:
        sender.close()


def test_a_pipelined_tensor_handle_goes_out_before_the_copies_and_readers_wait_for_each_bucket(tmp_path, monkeypatch):
    import threading

    from miles_sync.transports import tensor

    copying, release = threading.Event(), threading.Event()
    fill = tensor._fill

    def held_fill(header, views, bucket):
        copying.set()
        assert release.wait(30)
        fill(header, views, bucket)

    monkeypatch.setattr(tensor, "_fill", held_fill)
    monkeypatch.setattr(tensor, "QUEUED", 100)  # every bucket queued behind the held copy
    weights = sample_weights()
    sender = make_sender("tensor", tmp_path, pipeline=True, bucket_bytes=300, ready_timeout_s=0.5)
    try:
        handle = sender.publish(weights, weight_version=1)  # returns while the first copy is held
        assert copying.wait(30) and handle.num_buckets > 1
        # Another process (a payload is read once per process) gives up after ready_timeout_s.
        child = read_in_subprocess(handle, stderr=subprocess.PIPE)
        _, err = child.communicate(timeout=120)
        assert child.returncode != 0
        assert "TimeoutError: weight version 1: a bucket was not written within 0.5 s" in err.decode()
        release.set()
        sender.wait()

        release.clear()
        copying.clear()
        handle = sender.publish(weights, weight_version=2)
        assert copying.wait(30)
        got: dict = {}
        reader = threading.Thread(target=lambda: got.update(read_all(handle)))
        reader.start()
        time.sleep(0.2)
        assert not got and reader.is_alive(), "the reader waits for the bucket"
        release.set()
        sender.wait()
        reader.join(30)
        assert weight_fingerprint(got.items()) == handle.fingerprint == weight_fingerprint(weights)
        got.clear()  # the mapped buckets go before the sender frees their memory
    finally:
        release.set()
        sender.close()


def test_a_pipelined_publish_queues_a_few_buckets_not_the_whole_version(tmp_path, monkeypatch):
    """Buckets waiting for the copying thread hold their tensors (casts, quantized copies): publish waits once
    `QUEUED` are waiting, so a push never holds a second copy of the model."""
    import threading

    from miles_sync.transports import tensor

    release, filled = threading.Event(), []
    fill = tensor._fill

    def held_fill(header, views, bucket):
        assert release.wait(30)
        fill(header, views, bucket)
        filled.append(len(bucket))

    monkeypatch.setattr(tensor, "_fill", held_fill)
    monkeypatch.setattr(tensor, "QUEUED", 1)
    sender = make_sender("tensor", tmp_path, pipeline=True, bucket_bytes=300)
    handles: list = []
    try:
        publishing = threading.Thread(target=lambda: handles.append(sender.publish(sample_weights(), 1)))
        publishing.start()
        time.sleep(0.3)
        assert publishing.is_alive() and not handles, "publish waits for the held copy"
        assert len(sender._copies) == 2  # the one being copied and one queued
        release.set()
        publishing.join(30)
        assert handles[0].num_buckets > 2
        assert weight_fingerprint(read_all(handles[0]).items()) == handles[0].fingerprint
    finally:
        release.set()
        sender.close()


def test_a_failed_pipelined_copy_fails_its_readers_and_the_senders_wait(tmp_path, monkeypatch, caplog):
    from miles_sync.transports import tensor

    fill = tensor._fill

    def broken_fill(header, views, bucket):
        name, tensor_ = bucket[-1]
        fill(header, views, [*bucket[:-1], (name, tensor_.new_zeros(tensor_.numel() + 1))])  # cannot be copied

    monkeypatch.setattr(tensor, "_fill", broken_fill)
    sender = make_sender("tensor", tmp_path, pipeline=True, ready_timeout_s=30)
    try:
        handle = sender.publish(sample_weights(), weight_version=7)
        with pytest.raises(RuntimeError, match="weight version 7: the sender failed while copying it") as failed:
            read_all(handle)
        del failed  # its frames hold the mapped buckets, which must go before the sender frees their memory
        gc.collect()
        with pytest.raises(RuntimeError, match="size"):  # torch's own error about the copy
            sender.wait()
        sender.wait()  # reported once
        # Nobody waits this time (the runtime's push failed at the engine): close() logs the error, and the
        # buffers the copy's frames referenced are freed with the rest (torch aborts the process otherwise).
        handle = sender.publish(sample_weights(), weight_version=8)
        with pytest.raises(RuntimeError, match="weight version 8: the sender failed") as failed:
            read_all(handle)
        del failed
        gc.collect()
        with caplog.at_level("ERROR", logger="miles_sync.transports.tensor"):
            sender.close()
        gc.collect()
        assert "copying weight version 8 failed" in caplog.text
    finally:
        sender.close()


def test_broadcast_without_receivers_times_out_with_a_clear_error(tmp_path):
    sender = make_sender("broadcast", tmp_path, timeout_s=2)
    sender.publish(sample_weights(), weight_version=1)
    with pytest.raises(RuntimeError, match="broadcast transport: sending failed"):
        sender.wait()


def test_broadcast_group_counts_every_receiver(tmp_path):
    with pytest.raises(ValueError, match="receiver_ranks must be at least 1"):
        build_sender(BroadcastSync(), receiver_ranks=0)
    sender = build_sender(BroadcastSync(timeout_s=60), receiver_ranks=3)
    handle = sender.publish(sample_weights(), weight_version=1)
    assert handle.group.world_size == 4 and handle.group.backend == "gloo"
    readers = [read_in_subprocess(handle, rank) for rank in (1, 2, 3)]
    outs = [r.communicate(timeout=120)[0].decode().strip() for r in readers]
    sender.wait()
    assert outs == [handle.fingerprint] * 3
    sender.close()


def test_a_tied_head_is_never_published():
    from miles_sync import TIED_HEAD, without_tied_head

    weights = sample_weights()
    assert [n for n, _ in without_tied_head(weights, tied=True)] == [n for n, _ in weights if n != TIED_HEAD]
    assert [n for n, _ in without_tied_head(weights, tied=False)] == [n for n, _ in weights]


@pytest.mark.parametrize(
    ("wire", "engines", "resolved", "refused"),
    [
        ("auto", "bfloat16", "bfloat16", None),  # the common case: the checkpoint's dtype, no setting needed
        ("auto", "float32", "float32", None),
        ("bfloat16", "float32", "bfloat16", None),  # fp32 engines hold bf16 values exactly
        ("float32", "bfloat16", None, "sync.dtype: float32 is not what the engines hold"),
        ("float16", "bfloat16", None, "sync.dtype: float16 is not what the engines hold"),
        (None, "bfloat16", None, "sync.dtype: null sends the trainer's fp32 master weights"),
        (None, "float32", None, None),
    ],
)
def test_wire_dtype_resolves_against_the_engines(wire, engines, resolved, refused):
    config = DiskSync(dtype=wire)
    if refused:
        with pytest.raises(ValueError, match=refused):
            config.for_engines(engines)
        assert DiskSync(dtype=wire, check_weights=False).for_engines(engines).dtype == wire  # unchecked: allowed
    else:
        assert config.for_engines(engines).dtype == resolved


@pytest.mark.parametrize(
    ("wire", "engines", "runs"),
    [("auto", "bfloat16", "bfloat16"), ("bfloat16", "float32", "bfloat16"), (None, "float32", "float32")],
)
def test_the_precision_the_engines_run_after_a_push(wire, engines, runs):
    """What the trainer must forward with to train the engines' policy: bf16 sent to fp32 engines is bf16 there."""
    assert DiskSync(dtype=wire).for_engines(engines).pushed_precision(engines) == runs


def test_each_transport_takes_only_its_own_fields():
    """`sync` is a union told apart by `transport`: a field of another transport is refused by name."""
    assert isinstance(sync_config(), DiskSync)  # the default transport
    assert sync_config(transport="broadcast", master_port=29500).master_port == 29500
    for fields, field in [
        ({"transport": "tensor", "dir": "/tmp/x"}, "dir"),
        ({"master_port": 29500}, "master_port"),  # disk (the default) has no rendezvous
        ({"transport": "inproc", "keep_versions": 3}, "keep_versions"),
        ({"transport": "disk", "timeout_s": 5}, "timeout_s"),
    ]:
        with pytest.raises(ValidationError, match=f"{field}\\n  Extra inputs are not permitted"):
            sync_config(**fields)
    with pytest.raises(ValidationError, match="sync.transport must be one of inproc, disk, tensor, broadcast"):
        sync_config(transport="rdma")


def test_a_run_places_only_what_the_transport_leaves_to_it(tmp_path):
    assert DiskSync().placed(str(tmp_path)).dir == str(tmp_path)
    assert DiskSync(dir="/data/w").placed(str(tmp_path)).dir == "/data/w"  # a shared path the user chose stays
    assert sync_config(transport="tensor").placed(str(tmp_path)) == sync_config(transport="tensor")


def test_delta_pushes_send_what_changed_and_fingerprint_the_whole_version():
    weights = [(f"w{i}", torch.full((4, 4), float(i))) for i in range(6)]
    sender = build_sender(sync_config(transport="inproc", delta=True, bucket_bytes=64))
    whole = sender.publish(weights, weight_version=1)
    assert whole.base_version is None and whole.num_tensors == 6 and whole.unchanged_tensors == 0
    same = sender.publish(weights, weight_version=2)  # nothing moved: one tensor still carries the version
    assert same.base_version == 1 and same.num_tensors == 1 and same.unchanged_tensors == 5
    assert same.fingerprint == whole.fingerprint == weight_fingerprint(weights)
    moved = [(n, t + 1 if n in ("w1", "w4") else t) for n, t in weights]
    delta = sender.publish(moved, weight_version=3)
    assert delta.base_version == 2 and delta.num_bytes == 2 * 16 * 4
    assert sorted(n for b in read_buckets(delta) for n, _ in b) == ["w1", "w4"]
    assert delta.fingerprint == weight_fingerprint(moved)
    sender.forget_base()  # e.g. the engines were replaced: the next push is whole again
    assert sender.publish(moved, weight_version=4).num_tensors == 6
    # a change below the wire dtype's resolution rounds away: the tensor is unchanged for the engines
    bf16 = build_sender(sync_config(transport="inproc", delta=True, dtype="bfloat16"))
    bf16.publish(weights, weight_version=1)
    tiny = [(n, t + 1e-4 if n == "w3" else t) for n, t in weights]
    assert bf16.publish(tiny, weight_version=2).unchanged_tensors == 5  # w3 = 3.0001 is 3.0 in bf16; w0 carries
    with pytest.raises(ValueError, match="sync.delta with sync.quant_wire: packed"):
        sync_config(transport="tensor", delta=True, quantization="fp8_block", quant_wire="packed")


def test_check_after_resume_needs_the_check():
    assert sync_config(transport="tensor", check_after_resume=True).check_after_resume
    with pytest.raises(ValueError, match="sync.check_after_resume needs sync.check_weights: true"):
        sync_config(transport="tensor", check_after_resume=True, check_weights=False)


def test_compressed_disk_versions_round_trip_bit_exact_and_are_smaller(tmp_path):
    """compression: zstd writes each bucket as one zstd frame of byte-shuffled tensors: every dtype and shape comes
    back bit for bit (a 0-d tensor, an empty one, bool, bf16), and bf16 weights take fewer bytes than as
    safetensors."""
    g = torch.Generator().manual_seed(3)
    weights = sample_weights() + [
        ("empty", torch.zeros(0, 4)),
        ("mask", torch.rand(5, generator=g) > 0.5),
        ("big.weight", (torch.randn(256, 256, generator=g) * 0.02).to(torch.bfloat16)),
        ("view.weight", torch.randn(6, 4, generator=g).T),  # not contiguous
    ]
    sizes = {}
    for compression in ("none", "zstd"):
        sender = make_sender("disk", tmp_path / compression, compression=compression, bucket_bytes=4096)
        handle = sender.publish(weights, weight_version=1)
        assert handle.compression == compression
        got = read_all(handle)
        for name, tensor in weights:
            assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
            assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
        assert handle.fingerprint == weight_fingerprint(got.items())
        files = list(Path(handle.location).glob("bucket-*"))
        assert {f.suffix for f in files} == {".zst" if compression == "zstd" else ".safetensors"}
        sizes[compression] = sum(f.stat().st_size for f in files)
    assert sizes["zstd"] < 0.85 * sizes["none"]  # bf16 weights near 0 share their exponent bytes
    # a damaged file is an error naming it, not wrong weights
    damaged = next(Path(handle.location).glob("bucket-*.zst"))
    manifest = json.loads((Path(handle.location) / "manifest.json").read_text())
    entry = next(e for e in manifest["files"] if e["file"] == damaged.name)
    entry["layout"][0][2] = [s + 1 for s in entry["layout"][0][2]]
    (Path(handle.location) / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=f"{damaged.name}: holds .* bytes but its manifest lists"):
        read_all(handle)


def test_a_disk_delta_writes_only_what_changed_and_reaches_a_folder_reading_engine_as_tensors(tmp_path):
    """sync.delta on disk: the version folder holds only the changed tensors (bytes counted on disk), and an engine
    whose servers read folders gets a delta or compressed version as tensors (its servers cannot take part of a
    checkpoint, nor zstd)."""
    from miles_sync import receive

    weights = [(f"layer{i}.weight", torch.randn(64, 64)) for i in range(6)]
    for compression in ("none", "zstd"):
        sender = make_sender("disk", tmp_path / compression, delta=True, compression=compression, bucket_bytes=20000)
        whole = sender.publish(weights, weight_version=1)
        engine = ServerEngine()
        receive(whole, engine)
        assert engine.calls == ["load_folder" if compression == "none" else "load_tensors"]
        moved = [(n, t + 1 if i % 2 else t) for i, (n, t) in enumerate(weights)]
        delta = sender.publish(moved, weight_version=2)
        assert delta.base_version == 1 and delta.num_tensors == 3 and delta.unchanged_tensors == 3
        written = read_all(delta)
        assert sorted(written) == [n for i, (n, _) in enumerate(weights) if i % 2]
        on_disk = {
            v: sum(f.stat().st_size for f in Path(h.location).glob("bucket-*")) for v, h in ((1, whole), (2, delta))
        }
        assert on_disk[2] < 0.6 * on_disk[1]  # half the tensors
        engine = ServerEngine()
        receive(delta, engine)
        assert engine.calls == ["load_tensors"] and sorted(engine.tensors) == sorted(written)
        assert delta.fingerprint == weight_fingerprint(moved)


def test_disk_writes_views_and_shared_storages_and_copies_only_those(tmp_path):
    from miles_sync.transports.disk import _writable

    base = torch.randn(6, 4)
    bucket = [("a", base), ("b", base[2:4]), ("t", torch.randn(3, 5).T), ("c", torch.randn(4))]
    written = _writable(bucket)
    assert written["a"].data_ptr() == base.data_ptr() and written["c"].data_ptr() == bucket[3][1].data_ptr()
    assert written["b"].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()  # a second view: copied
    assert written["t"].is_contiguous()
    sender = build_sender(DiskSync(dir=str(tmp_path)))
    handle = sender.publish(bucket, weight_version=1)
    assert {n: t.tolist() for n, t in read_all(handle).items()} == {n: t.tolist() for n, t in bucket}


HANDLE_CLASSES = {
    "inproc": "InprocHandle",
    "disk": "DiskHandle",
    "tensor": "TensorHandle",
    "broadcast": "BroadcastHandle",
    "p2p": "P2PHandle",
}


def test_each_transport_has_its_own_typed_handle(transport, tmp_path):
    import dataclasses

    import miles_sync

    sender = make_sender(transport, tmp_path)
    transport = transport.removesuffix("-unpipelined")  # same handle
    try:
        handle = sender.publish(sample_weights(), weight_version=2)
        read_all(handle)  # a collective transport's sender finishes once a receiver took the version
        assert type(handle).__name__ == HANDLE_CLASSES[transport]
        assert isinstance(handle, getattr(miles_sync, HANDLE_CLASSES[transport]))
        assert handle.transport == transport  # the discriminator, fixed by the class
        own = {f.name for f in dataclasses.fields(handle)} - {
            f.name for f in dataclasses.fields(miles_sync.WeightHandle)
        }
        assert (
            own
            == {
                "inproc": {"buckets"},
                "disk": {"location", "compression"},
                "tensor": {"payloads", "ready_timeout_s"},
                "broadcast": {"group", "layout"},
                "p2p": {"group", "num_senders", "parts", "max_buckets_in_flight"},
            }[transport]
        )
        with pytest.raises(TypeError):  # a handle without what its receiver needs cannot be built
            type(handle)(weight_version=1, num_tensors=1, num_bytes=1, num_buckets=1, fingerprint="f")
    finally:
        sender.close()


@pytest.mark.parametrize("engine_type", [Collector, ServerEngine])
def test_receive_loads_every_transport_into_an_engine_through_its_capabilities(transport, engine_type, tmp_path):
    """The transport's receiver picks the engine's way in: tensors in this process for any engine, the folder
    or the group for an engine whose servers take those themselves."""
    from miles_sync import receive

    weights = sample_weights()
    sender = make_sender(transport, tmp_path, bucket_bytes=300)
    try:
        handle = sender.publish(weights, weight_version=5)
        engine = engine_type()
        receive(handle, engine)
        sender.wait()
        expected = "load_tensors"
        if engine_type is ServerEngine:
            expected = {"disk": "load_folder", "broadcast": "join_group"}.get(transport, "load_tensors")
        assert engine.calls == [expected]
        assert weight_fingerprint(list(engine.tensors.items())) == handle.fingerprint
        if expected == "load_folder":
            assert engine.folder == handle.location
    finally:
        sender.close()


def test_receive_refuses_an_object_that_cannot_take_weights(tmp_path):
    from miles_sync import receive

    handle = make_sender("inproc", tmp_path).publish(sample_weights(), weight_version=1)
    with pytest.raises(TypeError, match="object cannot take weights: it has no load_tensors"):
        receive(handle, object())  # type: ignore[arg-type]


def test_only_collective_transports_ask_for_receiver_ranks():
    from miles_sync import needs_receiver_ranks

    assert {t for t in TRANSPORTS if needs_receiver_ranks(sync_config(transport=t))} == {"broadcast"}


SHARDED_SENDER = """
import os, pickle, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
sys.path.insert(0, sys.argv[4])
from test_transports import sharded_weights
from miles_sync import P2PSync
from miles_sync.transports.p2p import P2PSender

rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
mesh = init_device_mesh("cpu", (2,))
held = [(n, distribute_tensor(t, mesh, [Replicate() if t.dim() == 0 else Shard(0)])) for n, t in sharded_weights()]
sender = P2PSender(P2PSync(bucket_bytes=256, timeout_s=60, max_buckets_in_flight=2), receiver_ranks=2)
handle = sender.publish(held, weight_version=3)
with open(out + ".tmp", "wb") as f:
    pickle.dump(handle, f)
os.replace(out + ".tmp", out + ".handle")  # whole when it appears
sender.wait()
with open(out + ".bytes", "w") as f:
    f.write(str(sender.bytes_sent))
dist.destroy_process_group()
"""


def sharded_weights() -> list[tuple[str, torch.Tensor]]:
    """Tensors whose rows split evenly, unevenly (7 rows: 4 + 3) and not at all (1 row: rank 1 holds none)."""
    g = torch.Generator().manual_seed(1)
    return [
        ("even.weight", torch.randn(8, 4, generator=g)),
        ("uneven.weight", torch.randn(7, 5, generator=g).to(torch.bfloat16)),
        ("one_row.bias", torch.randn(1, 3, generator=g)),
        ("counter", torch.tensor(11, dtype=torch.int64)),
    ]


def test_p2p_from_two_sharded_ranks_to_two_receivers_moves_each_byte_once(tmp_path):
    """Two trainer ranks holding FSDP2-style row shards (DTensor Shard(0)) send straight to two receiving ranks:
    each receiver gets bit-exact whole tensors, each rank sends only its own bytes (once per receiver), and the
    fingerprint taken over the pieces is what a receiver holding whole tensors computes."""
    import threading

    from miles_sync import combine
    from miles_sync.transports import p2p

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tests_dir = str(Path(__file__).parent)
    senders = [
        subprocess.Popen([sys.executable, "-c", SHARDED_SENDER, str(r), str(port), str(tmp_path / f"r{r}"), tests_dir])
        for r in (0, 1)
    ]
    try:
        handles = []
        for r in (0, 1):
            path = tmp_path / f"r{r}.handle"
            for _ in range(1200):
                if path.exists():
                    break
                assert senders[r].poll() is None, f"sender rank {r} exited with {senders[r].returncode}"
                time.sleep(0.1)
            handles.append(pickle.loads(path.read_bytes()))
        handle = combine(handles)
        assert handle.num_senders == 2 and handle.group.world_size == 4
        received: dict[int, dict[str, torch.Tensor]] = {}

        def take(index: int) -> None:
            received[index] = {n: t for bucket in p2p.read(handle, index) for n, t in bucket}

        readers = [threading.Thread(target=take, args=(i,)) for i in (0, 1)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(120)
        assert all(s.wait(120) == 0 for s in senders)
    finally:
        for s in senders:
            s.kill()
    full = dict(sharded_weights())
    for index in (0, 1):
        assert received[index].keys() == full.keys()
        for name, tensor in full.items():
            got = received[index][name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
            assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
    # the shards' row ranges are in the handle; the whole tensors hash to the senders' fingerprint over them
    assert handle.pieces == {"even.weight": [(0, 4), (4, 8)], "uneven.weight": [(0, 4), (4, 7)]}
    assert weight_fingerprint(received[0].items(), pieces=handle.pieces) == handle.fingerprint
    changed = dict(received[1], **{"uneven.weight": received[1]["uneven.weight"].clone()})
    changed["uneven.weight"][6, 0] += 1
    assert weight_fingerprint(changed.items(), pieces=handle.pieces) != handle.fingerprint
    # each byte once: a rank's bytes on the wire are its own pieces' bytes times the receivers
    total = sum(t.numel() * t.element_size() for t in full.values())
    parts = {p.rank: p.num_bytes for p in handle.parts}
    assert sum(parts.values()) == handle.num_bytes == total
    assert 0 < parts[1] < parts[0] < total  # rank 0 also holds the one-row tensor and the replicated counter
    sent = {r: int((tmp_path / f"r{r}.bytes").read_text()) for r in (0, 1)}
    assert sent == {r: 2 * parts[r] for r in (0, 1)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_p2p_combine_needs_every_rank_once_and_a_rank_may_hold_nothing():
    from miles_sync import P2PSync, combine
    from miles_sync.transports.p2p import P2PSender

    # no receiver joins: the senders fail in the background (gloo, which reports it; see docs/weights.md on NCCL)
    config = P2PSync(master_port=free_port(), timeout_s=1, backend="gloo")
    rank0, rank1 = (P2PSender(config, rank=r, num_senders=2) for r in (0, 1))
    held = rank0.publish(sample_weights(), weight_version=4)
    # plain tensors on every rank (a backend that hands each rank a copy): rank 1 holds them replicated, sends none
    empty = rank1.publish(sample_weights(), weight_version=4)
    assert empty.num_tensors == 0 and empty.parts[0].layout == []
    with pytest.raises(ValueError, match=r"got the parts of ranks \[0\] of 2"):
        combine([held])
    whole = combine([empty, held])
    assert whole.parts == held.parts and whole.fingerprint == weight_fingerprint(sample_weights())
    assert whole.pieces is None  # every tensor whole on one rank
    with pytest.raises(ValueError, match="refusing to publish an empty weight version"):
        P2PSender(P2PSync(backend="gloo")).publish([], weight_version=1)  # alone, a rank must hold something
    for sender in (rank0, rank1):
        with pytest.raises(RuntimeError, match=r"p2p transport: rank \d: sending failed"):
            sender.wait()


@pytest.mark.parametrize("transport", ["broadcast", "p2p"])
def test_a_group_sender_holds_its_port_from_publish_and_a_taken_port_fails_the_publish(transport):
    """The rendezvous port is bound inside publish, before the handle names it (no other process can take it
    in between); a fixed port that is taken fails publish itself, naming the address."""
    sender = build_sender(sync_config(transport=transport, timeout_s=1, backend="gloo"), receiver_ranks=1)
    handle = sender.publish(sample_weights(), weight_version=1)
    with socket.socket() as sock, pytest.raises(OSError):
        sock.bind(("127.0.0.1", handle.group.master_port))  # held by the sender's store
    assert re.fullmatch(r"miles-(weights|p2p)-[0-9a-f]{8}-v1", handle.group.group_name)  # unique per version
    with pytest.raises(RuntimeError, match="sending failed"):
        sender.wait()  # nobody joined within timeout_s
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        blocked = build_sender(
            sync_config(transport=transport, master_port=port, timeout_s=1, backend="gloo"), receiver_ranks=1
        )
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}"):
            blocked.publish(sample_weights(), weight_version=1)


def test_a_p2p_receiver_posts_at_most_the_window_and_keeps_each_senders_order(monkeypatch):
    """Receives go out ahead, at most `max_buckets_in_flight` at once (the bytes a receiver allocates, on its GPU
    with NCCL, stay bounded), the senders' first buckets first, each sender's buckets in its own order (NCCL
    matches a pair's calls in order)."""
    from miles_sync.transports import p2p
    from miles_sync.types import P2PHandle, Rendezvous, SenderPart

    posted: list[tuple[int, int]] = []
    outstanding = {"now": 0, "most": 0}

    class Work:
        def wait(self) -> None:
            outstanding["now"] -= 1

    class Recorder:
        def __init__(self, r, rank, store=None) -> None:
            pass

        def irecv(self, tensor, src, tag):
            posted.append((src, tag))
            outstanding["now"] += 1
            outstanding["most"] = max(outstanding["most"], outstanding["now"])
            return Work()

        def close(self) -> None:
            pass

    monkeypatch.setattr(p2p, "_Group", Recorder)
    bucket = lambda i: [(f"t{i}", "float32", [2], f"t{i}", 0, [2])]  # noqa: E731
    parts = [
        SenderPart(rank=r, layout=[bucket(f"{r}{b}") for b in range(n)], num_bytes=8 * n, digests={})
        for r, n in ((0, 3), (1, 2))
    ]
    group = Rendezvous(master_address="x", master_port=1, group_name="g", world_size=3, backend="gloo", timeout_s=1)
    handle = P2PHandle(
        weight_version=1, num_tensors=5, num_bytes=40, num_buckets=5, fingerprint="f", group=group, num_senders=2,
        parts=parts, max_buckets_in_flight=2,
    )  # fmt: skip
    names = [n for bucket in p2p.read(handle) for n, _ in bucket]
    assert posted == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]
    assert outstanding["most"] == 2 and sorted(names) == sorted(
        f"t{r}{b}" for r, n in ((0, 3), (1, 2)) for b in range(n)
    )


def test_a_wildcard_master_address_advertises_this_hosts_address_and_refuses_a_loopback_one(monkeypatch):
    from miles_sync.transports import group

    assert group.advertised("10.0.0.7") == "10.0.0.7"  # an address given is advertised as it is
    monkeypatch.setattr(group.socket, "gethostbyname", lambda name: "10.1.2.3")
    assert group.advertised("0.0.0.0") == "10.1.2.3"
    monkeypatch.setattr(group.socket, "gethostbyname", lambda name: "127.0.1.1")  # Debian's default /etc/hosts
    with pytest.raises(ValueError, match="resolves to 127.0.1.1 \\(loopback\\), which other nodes cannot reach"):
        group.advertised("0.0.0.0")
