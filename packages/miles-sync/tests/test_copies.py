"""The copy counter of the benchmarks (`miles_sync.copies`), and the copies each sender makes per byte."""

from __future__ import annotations

import pytest
import torch

from miles_sync import build_sender, sync_config
from miles_sync.copies import CopyCount


def test_the_counter_sees_torch_copies_and_file_writes_but_not_views(tmp_path):
    x = torch.randn(1000)  # 4000 bytes
    with CopyCount() as views:
        y = x.view(10, 100).T[:, 2:5].view(torch.int32)  # views: no byte moves
    assert views.tensor_bytes == 0 and views.ops == {}
    with CopyCount() as made_contiguous:
        y.contiguous()  # 100 × 3 elements gathered into a new tensor
    assert made_contiguous.tensor_bytes == 1200
    with CopyCount() as copies:
        x.clone()
        x.to(torch.bfloat16)  # a cast writes 2 bytes per element
        torch.empty(1000).copy_(x)
        (tmp_path / "f").write_bytes(b"\0" * 5000)
    assert copies.tensor_bytes == 4000 + 2000 + 4000
    assert copies.ops == {"clone": 4000, "_to_copy": 2000, "copy_": 4000}
    assert 5000 <= copies.written_bytes < 5500
    assert copies.per_byte(4000) >= (10000 + 5000) / 4000
    del y


def test_each_sender_copies_every_byte_once(tmp_path):
    """The version's own copy is the only one: into shared memory (tensor), into the flat wire buckets
    (broadcast), into files (disk). A clone before flattening, or a copy before writing, fails this."""
    weights = [(f"w{i}", torch.randn(256, 1024)) for i in range(4)]  # 4 MiB
    num_bytes = sum(t.numel() * t.element_size() for _, t in weights)
    for transport in ("tensor", "broadcast", "disk"):
        extra: dict = {"dir": str(tmp_path / "w")} if transport == "disk" else {}
        if transport == "broadcast":
            extra = {"timeout_s": 1}  # nobody receives: each version's sending thread gives up after 1 s
        if transport == "tensor":
            extra = {"pipeline": False}  # its copies inside publish, in the thread the counter sees
        sender = build_sender(sync_config(transport=transport, **extra))
        for version in (1, 2):  # the first is a warm-up: first-use imports read files
            with CopyCount() as copies:
                sender.publish(weights, weight_version=version)
            if transport == "broadcast":
                with pytest.raises(RuntimeError, match="sending failed"):
                    sender.wait()
        assert 1.0 <= copies.per_byte(num_bytes) < 1.01, (transport, copies.ops, copies.written_bytes)
        if transport != "broadcast":
            sender.close()
