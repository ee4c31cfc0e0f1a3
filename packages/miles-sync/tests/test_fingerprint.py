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
