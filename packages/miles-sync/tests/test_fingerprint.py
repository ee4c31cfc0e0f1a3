import torch

from miles_sync import weight_fingerprint


def weights():
    return [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.ones(4))]


def test_order_independent():
    assert weight_fingerprint(weights()) == weight_fingerprint(list(reversed(weights())))


def test_one_bit_changes_it():
    w = weights()
    bits = w[0][1].view(torch.int32)
    bits[0, 0] ^= 1  # flip the lowest mantissa bit
    assert weight_fingerprint(w) != weight_fingerprint(weights())


def test_names_shapes_and_dtypes_matter():
    base = weight_fingerprint(weights())
    assert weight_fingerprint([("a2", weights()[0][1]), weights()[1]]) != base
    assert weight_fingerprint([("a", weights()[0][1].reshape(3, 2)), weights()[1]]) != base
    assert weight_fingerprint(weights(), dtype=torch.bfloat16) != base


def test_views_and_narrow_dtypes_hash_their_values_not_their_memory_layout():
    t = torch.randn(8, 4)
    assert weight_fingerprint([("t", t.T)]) == weight_fingerprint([("t", t.T.contiguous())])
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8):
        x = torch.randn(64, 32).to(dtype)
        y = x.clone()
        y.view(torch.uint8).reshape(-1)[-1] ^= 1  # the last byte: hashed too
        assert weight_fingerprint([("x", x)]) != weight_fingerprint([("x", y)])
    assert weight_fingerprint([("s", torch.tensor(3.0))]) != weight_fingerprint([("s", torch.tensor(4.0))])


def test_digest_is_xxh3_128_of_name_dtype_shape_and_bytes():
    import xxhash

    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    one = xxhash.xxh3_128(b"w" + b"torch.bfloat16" + b"(3, 4)" + t.view(torch.uint8).numpy().tobytes()).digest()
    assert weight_fingerprint([("w", t)]) == xxhash.xxh3_128(one).hexdigest()
