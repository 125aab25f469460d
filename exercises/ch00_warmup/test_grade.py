"""Grader for exercise 0: your rms_norm and RoPE against minillm's, plus the properties RoPE must have."""

import pytest
import torch
from torch.testing import assert_close


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def rope_tables(ref, head_dim=16, positions=64, theta=10000.0):
    return ref.rope_cos_sin(ref.rope_inv_freq(head_dim, theta), positions)


@pytest.mark.points(2)
def test_rms_norm_matches_reference(impl, ref):
    for seed, shape in enumerate([(1, 8), (3, 7), (2, 5, 33), (4, 64), (1, 1)]):
        x, weight = randn(*shape, seed=seed), randn(shape[-1], seed=100 + seed)
        assert_close(impl.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6), msg=lambda m: f"shape {shape}: {m}")


@pytest.mark.points(1)
def test_rms_norm_bf16_keeps_dtype(impl, ref):
    x, weight = randn(3, 5, 48, seed=1, dtype=torch.bfloat16), randn(48, seed=2, dtype=torch.bfloat16)
    assert_close(impl.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5), msg=lambda m: f"bf16 input: {m}")


@pytest.mark.points(1)
def test_rms_norm_extreme_magnitudes(impl, ref):
    for scale in (1e-3, 1e12):  # tiny and huge float32 inputs
        x, weight = randn(2, 37, seed=3, scale=scale), randn(37, seed=4)
        assert_close(impl.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6), msg=lambda m: f"|x| ~ {scale:g}: {m}")
    x, weight = randn(2, 64, seed=5, dtype=torch.float16, scale=1000.0), randn(64, seed=6, dtype=torch.float16)
    assert_close(impl.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6),
                 msg=lambda m: f"fp16 |x| ~ 1000 (x**2 overflows fp16; normalize in float32): {m}")


@pytest.mark.points(1)
def test_rms_norm_eps(impl, ref):
    weight = randn(16, seed=7)
    zeros = impl.rms_norm(torch.zeros(2, 16), weight, 1e-6)
    assert_close(zeros, torch.zeros(2, 16), msg=lambda m: f"all-zero input must give zeros, not NaN: {m}")
    x = randn(3, 16, seed=8, scale=1e-3)  # mean(x**2) ~ 1e-6, so eps decides the scale
    for eps in (1e-6, 1e-2):
        assert_close(impl.rms_norm(x, weight, eps), ref.rms_norm(x, weight, eps), msg=lambda m: f"eps={eps:g}: {m}")


@pytest.mark.points(1)
def test_rope_inv_freq_matches_reference(impl, ref):
    for head_dim, theta in [(2, 10000.0), (16, 10000.0), (64, 100000.0), (128, 500000.0)]:
        assert_close(impl.rope_inv_freq(head_dim, theta), ref.rope_inv_freq(head_dim, theta),
                     msg=lambda m: f"head_dim={head_dim}, theta={theta:g}: {m}")


@pytest.mark.points(1)
def test_rope_cos_sin_matches_reference(impl, ref):
    for head_dim, positions in [(2, 1), (16, 37), (64, 512)]:
        inv_freq = ref.rope_inv_freq(head_dim, 10000.0)
        (cos, sin), (ref_cos, ref_sin) = impl.rope_cos_sin(inv_freq, positions), ref.rope_cos_sin(inv_freq, positions)
        where = f"head_dim={head_dim}, max_positions={positions}"
        assert_close(cos, ref_cos, atol=2e-4, rtol=0, msg=lambda m: f"cos, {where}: {m}")
        assert_close(sin, ref_sin, atol=2e-4, rtol=0, msg=lambda m: f"sin, {where}: {m}")


@pytest.mark.points(2)
def test_apply_rope_matches_reference(impl, ref):
    cos, sin = rope_tables(ref)
    for seed, (positions, heads, dtype) in enumerate([([5], 1, torch.float32), ([0, 3, 9, 2, 63], 3, torch.float32),
                                                      ([7, 8, 9], 5, torch.bfloat16)]):
        x = randn(len(positions), heads, 16, seed=seed, dtype=dtype)
        c, s = cos[positions].to(dtype), sin[positions].to(dtype)
        assert_close(impl.apply_rope(x, c, s), ref.apply_rope(x, c, s),
                     msg=lambda m: f"{len(positions)} tokens, {heads} heads, {dtype}: {m}")


@pytest.mark.points(1)
def test_rope_position_zero_is_identity(impl):
    cos, sin = impl.rope_cos_sin(impl.rope_inv_freq(32, 10000.0), 4)
    x = randn(1, 3, 32, seed=9)
    assert_close(impl.apply_rope(x, cos[:1], sin[:1]), x, msg=lambda m: f"rotation at position 0 must change nothing: {m}")


@pytest.mark.points(1)
def test_rope_preserves_norm(impl):
    cos, sin = impl.rope_cos_sin(impl.rope_inv_freq(32, 10000.0), 256)
    positions = torch.tensor([1, 17, 100, 255])
    x = randn(4, 3, 32, seed=10)
    rotated = impl.apply_rope(x, cos[positions], sin[positions])
    assert_close(rotated.norm(dim=-1), x.norm(dim=-1), msg=lambda m: f"a rotation keeps each head vector's length: {m}")


@pytest.mark.points(1)
def test_rope_relative_position(impl):
    cos, sin = impl.rope_cos_sin(impl.rope_inv_freq(32, 10000.0), 128)
    q, k = randn(1, 1, 32, seed=11), randn(1, 1, 32, seed=12)

    def score(q_pos, k_pos):
        rq = impl.apply_rope(q, cos[[q_pos]], sin[[q_pos]])
        rk = impl.apply_rope(k, cos[[k_pos]], sin[[k_pos]])
        return (rq * rk).sum()

    for q_pos, k_pos in [(5, 2), (40, 40), (3, 10)]:
        for shift in (1, 50):
            assert_close(score(q_pos + shift, k_pos + shift), score(q_pos, k_pos), atol=1e-4, rtol=1e-4,
                         msg=lambda m: f"q·k must depend only on the position gap {q_pos - k_pos} (shift {shift}): {m}")
