"""Contract suite for every transport: publish → read back is bit-exact, bucketed, versioned."""

import pytest
import torch

from miles_sync import TRANSPORTS, SyncConfig, build_sender, read_buckets, weight_fingerprint


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


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    return request.param


def make_sender(transport: str, tmp_path, **kwargs):
    return build_sender(SyncConfig(transport=transport, dir=str(tmp_path / "w"), **kwargs))


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
    buckets = list(read_buckets(handle))
    assert handle.num_buckets == len(buckets) > 1
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= 300 or len(bucket) == 1
    assert read_all(handle).keys() == {n for n, _ in weights}


def test_wire_dtype_casts_floats_only(transport, tmp_path):
    weights = sample_weights()
    handle = make_sender(transport, tmp_path, dtype="bfloat16").publish(weights, weight_version=1)
    got = read_all(handle)
    assert got["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(got["lm_head.weight"], dict(weights)["lm_head.weight"].to(torch.bfloat16))
    assert got["step_counter"].dtype == torch.int64
    assert handle.fingerprint == weight_fingerprint(weights, dtype=torch.bfloat16)


def test_published_version_is_immutable(transport, tmp_path):
    weights = sample_weights()
    sender = make_sender(transport, tmp_path)
    handle = sender.publish(weights, weight_version=1)
    weights[0][1].add_(1.0)  # the trainer keeps training after publishing
    assert read_all(handle)["model.embed_tokens.weight"].sum() != weights[0][1].sum()
    assert weight_fingerprint(read_all(handle).items()) == handle.fingerprint


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

    with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'"):
        read_buckets(dataclasses.replace(handle, transport="carrier-pigeon"))


def test_disk_prunes_only_its_own_versions(tmp_path):
    other = make_sender("disk", tmp_path)
    foreign = other.publish(sample_weights(), weight_version=900)  # another run sharing the folder
    mine = make_sender("disk", tmp_path, keep_versions=1)
    mine.publish(sample_weights(), weight_version=1)
    latest = mine.publish(sample_weights(), weight_version=2)
    assert read_all(foreign).keys() == read_all(latest).keys()
    assert not (tmp_path / "w" / "v00000001").exists()
