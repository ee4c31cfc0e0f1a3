"""`miles bench weights`: the cost fit recovers known costs, and the projection follows its formula."""

import math

import pytest

from miles_control.bench.weights import MIB, Fit, Point, Scale, fit, project


def points(t0: float, t_bucket: float, t_byte: float, noise: float = 0.0) -> list[Point]:
    out = []
    for i, (size, bucket) in enumerate((s, b) for s in (16, 64, 256) for b in (4, 64)):
        n = math.ceil(size / bucket)
        wobble = noise * (1 if i % 2 else -1)
        out.append(Point("disk", size * MIB, bucket * MIB, n, t0 + n * t_bucket + size * MIB * t_byte + wobble))
    return out


def test_the_fit_recovers_the_costs_that_made_the_points():
    [f] = fit(points(0.004, 0.0015, 2e-9))
    assert f.t0 == pytest.approx(0.004, rel=1e-6)
    assert f.t_bucket == pytest.approx(0.0015, rel=1e-6)
    assert f.t_byte == pytest.approx(2e-9, rel=1e-6)
    assert f.r2 == pytest.approx(1.0) and f.points == 6 and f.gb_per_s == pytest.approx(0.5)
    [noisy] = fit(points(0.0, 0.0015, 2e-9, noise=0.002))  # t0 ≈ 0: noise must not make a negative cost
    assert noisy.t0 >= 0 and noisy.t_bucket >= 0 and noisy.t_byte == pytest.approx(2e-9, rel=0.05)
    assert 0.9 < noisy.r2 < 1.0


def test_the_projection_is_its_formula_and_names_what_bounds_it():
    f = Fit("disk", t0=0.01, t_bucket=0.002, t_byte=1e-9, r2=1.0, points=6)  # 1 GB/s here
    scale = Scale(params=1e9, bytes_per_param=2, senders=1, engines=4, link_gb_s=2.0, bucket_bytes=1 << 30)
    p = project(f, scale)
    # 2 GB from one sender; disk: each of 4 engines reads it, so 4 bytes per byte over a 2 GB/s link (2e-9 s/B)
    assert p["buckets"] == math.ceil(2e9 / (1 << 30)) == 2
    assert p["seconds"] == pytest.approx(0.01 + 2 * 0.002 + 2e9 * 2e-9)
    assert p["bound"] == "link"
    b = project(Fit("broadcast", 0.01, 0.002, 1e-9, 1.0, 6), scale)  # the group forwards: fanout 1 → 0.5e-9 < 1e-9
    assert b["bound"] == "this machine" and b["byte_s"] == pytest.approx(2e9 * 1e-9)
    wide = Scale(1e9, 2, 4, 4, 2.0, 1 << 30)  # four trainer ranks
    p2p = project(Fit("p2p", 0.01, 0.002, 1e-9, 1.0, 6), wide)  # each sends its 0.5 GB to each of 4 engines
    assert p2p["buckets"] == 1 and p2p["bound"] == "link" and p2p["byte_s"] == pytest.approx(0.5e9 * 4 / 2e9)
    rank0 = project(Fit("broadcast", 0.01, 0.002, 1e-9, 1.0, 6), wide)  # broadcast sends from rank 0 alone
    assert rank0["buckets"] == 2 and rank0["byte_s"] == pytest.approx(2e9 * 1e-9)
