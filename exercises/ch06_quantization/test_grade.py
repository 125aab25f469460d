"""Grader for exercise 6: your int4 quantizer, packing, Q4_1 decoder, int4 product and error measure against
minillm's and the `gguf` package."""

import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch.testing import assert_close

SHAPES = [(8, 64, 32), (16, 96, 32), (5, 128, 64), (3, 256, 128), (2, 24, 8)]  # (out, in, group_size)
MATMUL_SHAPES = [(1, 16, 64, 32), (4, 48, 256, 64), (7, 64, 512, 128), (3, 24, 96, 32), (16, 32, 128, 8)]  # M, N, K, G


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def q4_1_block(d: float, m: float, q: list[int]) -> bytes:
    """One Q4_1 block: fp16 d, fp16 m, then byte j = q[j] | q[j + 16] << 4."""
    return struct.pack("<ee", d, m) + bytes(q[j] | q[j + 16] << 4 for j in range(16))


def random_q4_1(n: int, seed: int) -> bytes:
    """n random Q4_1 blocks with finite d and m (random bytes there could spell NaN or inf)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, 20), dtype=np.uint8)
    blocks[:, :4] = (rng.standard_normal((n, 2)) * 0.05).astype(np.float16).view(np.uint8)
    return blocks.tobytes()


@pytest.mark.points(1)
def test_quantize_int4_shapes_and_range(impl):
    for seed, (out, inp, g) in enumerate(SHAPES):
        for dtype in (torch.float32, torch.bfloat16):
            q, scale, zero = impl.quantize_int4(randn(out, inp, seed=seed, dtype=dtype), g)
            where = f"w [{out}, {inp}] {dtype}, group {g}"
            assert q.dtype == torch.uint8 and q.shape == (out, inp), f"{where}: q is {q.dtype} {tuple(q.shape)}"
            assert 0 <= int(q.min()) and int(q.max()) <= 15, f"{where}: q outside 0..15"
            for name, t in (("scale", scale), ("zero", zero)):
                assert t.dtype == torch.float32 and t.shape == (out, inp // g), \
                    f"{where}: {name} is {t.dtype} {tuple(t.shape)}, expected float32 ({out}, {inp // g})"


@pytest.mark.points(2)
def test_quantize_int4_within_half_a_step(impl):
    for seed, (out, inp, g) in enumerate(SHAPES):
        w = randn(out, inp, seed=10 + seed, scale=0.05 * (seed + 1))
        q, scale, zero = impl.quantize_int4(w, g)
        groups = w.view(out, -1, g)
        assert_close(zero, groups.amin(-1), msg=lambda e: f"group {g}: zero is each group's minimum: {e}")
        assert_close(scale, (groups.amax(-1) - groups.amin(-1)) / 15,
                     msg=lambda e: f"group {g}: scale is each group's (max - min) / 15: {e}")
        deq = (q.float().view(out, -1, g) * scale[..., None] + zero[..., None])
        error = (deq - groups).abs()
        bound = scale[..., None] / 2 * (1 + 1e-5) + 1e-7
        assert (error <= bound).all(), (f"w [{out}, {inp}], group {g}: an element is {float((error - bound).max()):.3g}"
                                        f" beyond half a step from its value: round to the nearest q")


@pytest.mark.points(2)
def test_quantize_int4_matches_reference(impl, ref):
    for seed, (out, inp, g) in enumerate(SHAPES):
        w = randn(out, inp, seed=20 + seed)
        (q, scale, zero), (rq, rscale, rzero) = impl.quantize_int4(w, g), ref.quantize_int4(w, g)
        assert_close(scale, rscale, msg=lambda e: f"scale, group {g}: {e}")
        assert_close(zero, rzero, msg=lambda e: f"zero, group {g}: {e}")
        exact = (w.double().view(out, -1, g) - rzero.double()[..., None]) / rscale.double()[..., None]
        tie = ((exact - exact.floor() - 0.5).abs() < 1e-3).view(out, inp)  # halfway: either neighbour is fine
        differ = q.to(torch.int16) != rq.to(torch.int16)
        off_by_more = (q.to(torch.int16) - rq.to(torch.int16)).abs() > 1
        assert not (differ & ~tie).any() and not off_by_more.any(), (
            f"w [{out}, {inp}], group {g}: {int((differ & ~tie).sum())} q differ from minillm's away from a tie")


@pytest.mark.points(1)
def test_quantize_int4_constant_groups_and_errors(impl):
    w = randn(4, 64, seed=30)
    w[0] = 0.0
    w[1, :32] = 0.75
    w[2, 32:] = -3.0
    q, scale, zero = impl.quantize_int4(w, 32)
    assert torch.isfinite(scale).all() and (scale > 0).all(), "a constant group needs a positive, finite scale"
    deq = (q.float().view(4, 2, 32) * scale[..., None] + zero[..., None]).view(4, 64)
    for row, cols in [(0, slice(None)), (1, slice(0, 32)), (2, slice(32, None))]:
        assert (q[row, cols] == 0).all(), f"row {row}: a constant group's q are all 0"
        assert torch.equal(deq[row, cols], w[row, cols]), f"row {row}: a constant group dequantizes exactly"
    for bad, g in [(randn(4, 48, seed=31), 32), (randn(64, seed=32), 32), (randn(2, 4, 32, seed=33), 32)]:
        with pytest.raises(ValueError):
            impl.quantize_int4(bad, g)
            pytest.fail(f"w of shape {tuple(bad.shape)} with group {g}: no ValueError")


@pytest.mark.points(2)
def test_dequantize_int4(impl, ref):
    for seed, (out, inp, g) in enumerate(SHAPES):
        gen = torch.Generator().manual_seed(40 + seed)
        q = torch.randint(0, 16, (out, inp), dtype=torch.uint8, generator=gen)
        scale, zero = torch.rand(out, inp // g, generator=gen) * 0.01, torch.randn(out, inp // g, generator=gen)
        got = impl.dequantize_int4(q, scale, zero)
        assert got.dtype == torch.float32 and got.shape == (out, inp), f"got {got.dtype} {tuple(got.shape)}"
        assert_close(got, ref.dequantize_int4(q, scale, zero), msg=lambda e: f"[{out}, {inp}], group {g}: {e}")
    w = randn(6, 96, seed=45)
    assert_close(impl.dequantize_int4(*ref.quantize_int4(w, 32)), ref.dequantize_int4(*ref.quantize_int4(w, 32)),
                 msg=lambda e: f"minillm's quantized weight: {e}")


@pytest.mark.points(2)
def test_pack_int4_exact_bytes(impl, ref):
    assert impl.pack_int4(torch.tensor([1, 2, 3, 4], dtype=torch.uint8)).tolist() == [0x21, 0x43], \
        "q = [1, 2, 3, 4] packs to [0x21, 0x43]: element 2i in the low nibble"
    for seed, shape in enumerate([(2,), (7, 64), (3, 5, 18), (1, 1, 1, 2)]):
        q = torch.randint(0, 16, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(50 + seed))
        got, want = impl.pack_int4(q), ref.pack_int4(q)
        assert got.dtype == torch.uint8 and got.shape == want.shape, \
            f"q {tuple(shape)}: packed {got.dtype} {tuple(got.shape)}, expected uint8 {tuple(want.shape)}"
        assert torch.equal(got, want), f"q {tuple(shape)}: bytes differ from minillm's"


@pytest.mark.points(1)
def test_unpack_int4(impl, ref):
    assert impl.unpack_int4(torch.tensor([0x21, 0x43, 0xF0], dtype=torch.uint8)).tolist() == [1, 2, 3, 4, 0, 15]
    for seed, shape in enumerate([(1,), (7, 32), (3, 5, 9)]):
        packed = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(60 + seed))
        got, want = impl.unpack_int4(packed), ref.unpack_int4(packed)
        assert got.dtype == torch.uint8 and got.shape == want.shape, \
            f"packed {tuple(shape)}: unpacked {got.dtype} {tuple(got.shape)}, expected uint8 {tuple(want.shape)}"
        assert torch.equal(got, want), f"packed {tuple(shape)}: values differ from minillm's"


@pytest.mark.points(1)
def test_pack_unpack_round_trip_and_odd_length(impl):
    q = torch.randint(0, 16, (9, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(70))
    assert torch.equal(impl.unpack_int4(impl.pack_int4(q)), q), "unpack(pack(q)) must give q back"
    with pytest.raises(ValueError):
        impl.pack_int4(torch.zeros(4, 7, dtype=torch.uint8))
        pytest.fail("an odd last dimension (7): no ValueError")


@pytest.mark.points(2)
def test_decode_q4_1_hand_built_blocks(impl):
    q = list(range(16)) + [15 - i for i in range(16)]
    got = impl.decode_q4_1(q4_1_block(0.5, -2.0, q))
    what = f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.shape == (32,), \
        f"one block gives a float32 tensor of 32 weights, got {what}"
    nibbles = impl.decode_q4_1(struct.pack("<ee", 1.0, 0.0) + bytes([0x21] + [0] * 15)).tolist()
    assert nibbles[0] == 1 and nibbles[16] == 2 and sum(nibbles) == 3, \
        "byte j holds weight j in its low nibble and weight j + 16 in its high nibble"
    assert got.tolist() == [0.5 * v - 2.0 for v in q], "w = d * q + m, with d = 0.5, m = -2"
    two = impl.decode_q4_1(q4_1_block(0.25, 1.0, [3] * 32) + q4_1_block(-1.0, 0.0, [15] * 32))
    assert two.tolist() == [1.75] * 32 + [-15.0] * 32, "two blocks: 64 weights, the first block's first"


@pytest.mark.points(2)
def test_decode_q4_1_matches_gguf(impl, ref):
    for n in (1, 3, 64):
        raw = random_q4_1(n, seed=80 + n)
        got = impl.decode_q4_1(raw)
        want = torch.from_numpy(dequantize(np.frombuffer(raw, dtype=np.uint8), GGMLQuantizationType.Q4_1))
        assert got.dtype == torch.float32 and got.shape == (32 * n,), f"{n} blocks: got {got.dtype} {tuple(got.shape)}"
        assert torch.equal(got, want.reshape(-1)), f"{n} random blocks differ from the gguf package's dequantize"
        assert torch.equal(got, ref.decode_q4_1(raw)), f"{n} random blocks differ from minillm's"


@pytest.mark.points(1)
def test_decode_q4_1_rejects_partial_blocks(impl):
    assert impl.decode_q4_1(random_q4_1(2, seed=90)).shape == (64,)
    for size in (19, 21, 41, 1):
        with pytest.raises(ValueError):
            impl.decode_q4_1(bytes(size))
            pytest.fail(f"{size} bytes is not a whole number of 20-byte blocks: no ValueError")


@pytest.mark.points(2)
def test_int4_matmul_matches_dequantized_product(impl, ref):
    for seed, (m, n, k, g) in enumerate(MATMUL_SHAPES):
        q, scale, zero = ref.quantize_int4(randn(n, k, seed=100 + seed), g)
        x = randn(m, k, seed=110 + seed)
        y = impl.int4_matmul(x, ref.pack_int4(q), scale, zero, g)
        where = f"x [{m}, {k}], W [{n}, {k}], group {g}"
        what = f"{y.dtype} {tuple(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__
        assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and y.shape == (m, n), \
            f"{where}: y is {what}, expected float32 ({m}, {n})"
        assert_close(y, x @ ref.dequantize_int4(q, scale, zero).T, rtol=1e-4, atol=1e-4,
                     msg=lambda e: f"{where}: y differs from x @ W.T with W dequantized by minillm: {e}")


@pytest.mark.points(1)
def test_int4_matmul_half_precision_activations(impl, ref):
    q, scale, zero = ref.quantize_int4(randn(32, 256, seed=120), 64)
    for dtype in (torch.bfloat16, torch.float16):
        x, s, z = randn(5, 256, seed=121, dtype=dtype), scale.to(dtype), zero.to(dtype)  # as a layer stores them
        y = impl.int4_matmul(x, ref.pack_int4(q), s, z, 64)
        assert y.dtype == dtype and y.shape == (5, 32), f"{dtype} x: y is {y.dtype} {tuple(y.shape)}"
        want = x.float() @ ref.dequantize_int4(q, s.float(), z.float()).T
        error = float((y.float() - want).norm() / want.norm())
        assert error < 1e-2, f"{dtype} x: y is {error:.2%} off the float32 product (relative Frobenius error)"


@pytest.mark.points(1)
def test_int4_matmul_rejects_mismatched_shapes(impl, ref):
    q, scale, zero = ref.quantize_int4(randn(16, 128, seed=130), 32)
    packed, x = ref.pack_int4(q), randn(2, 128, seed=131)
    assert impl.int4_matmul(x, packed, scale, zero, 32).shape == (2, 16), "x [2, 128] @ W.T for W [16, 128]"
    bad = {"x [2, 127] for K = 128": (randn(2, 127, seed=132), packed, scale, zero, 32),
           "x [2, 64] for K = 128": (randn(2, 64, seed=133), packed, scale, zero, 32),
           "a 1-D x": (randn(128, seed=134), packed, scale, zero, 32),
           "scale [16, 3] for [16, 4]": (x, packed, scale[:, :3], zero, 32),
           "zero [15, 4] for [16, 4]": (x, packed, scale, zero[:15], 32),
           "group 64 with the scales of group 32": (x, packed, scale, zero, 64),
           "group 256 for K = 128": (x, packed, scale, zero, 256)}
    for what, args in bad.items():
        with pytest.raises(ValueError):
            impl.int4_matmul(*args)
            pytest.fail(f"{what}: no ValueError")


@pytest.mark.points(2)
def test_quantization_error_matches_reference(impl, ref):
    cases = [(16, 256, [8, 32, 128, 256], torch.float32), (5, 96, [32, 96], torch.float32),
             (8, 128, [64, 16], torch.bfloat16)]
    for seed, (out, inp, groups, dtype) in enumerate(cases):
        w = randn(out, inp, seed=140 + seed, dtype=dtype)
        got, want = impl.quantization_error(w, groups), ref.quantization_error(w, groups)
        assert isinstance(got, dict) and list(got) == groups, \
            f"w [{out}, {inp}]: expected a dict keyed by the group sizes {groups} in order, got {got!r}"
        assert all(isinstance(v, float) for v in got.values()), f"the errors must be Python floats, got {got!r}"
        for g in groups:
            assert got[g] == pytest.approx(want[g], rel=1e-4), \
                f"w [{out}, {inp}] {dtype}, group {g}: error {got[g]:.6g}, minillm's {want[g]:.6g}"


@pytest.mark.points(1)
def test_quantization_error_grows_with_group_size(impl):
    w = randn(64, 512, seed=150)
    outliers = torch.randint(0, w.numel(), (40,), generator=torch.Generator().manual_seed(151))
    w.view(-1)[outliers] *= 20  # a few large weights, as real layers have: they stretch their group's range
    groups = [8, 16, 32, 64, 128, 256, 512]
    errors = impl.quantization_error(w, groups)
    values = [errors[g] for g in groups]
    shown = ", ".join(f"G={g}: {e:.4f}" for g, e in zip(groups, values))
    assert all(a < b for a, b in zip(values, values[1:])), f"the error must grow with the group size: {shown}"
    assert values[-1] > 3 * values[0], f"a whole row per group should lose over 3x more than groups of 8: {shown}"


@pytest.mark.points(1)
def test_quantization_error_zero_on_an_int4_grid(impl):
    gen = torch.Generator().manual_seed(160)
    out, inp, g = 8, 128, 32
    q = torch.randint(0, 16, (out, inp), generator=gen)
    q.view(out, -1, g)[..., 0], q.view(out, -1, g)[..., 1] = 0, 15  # each group spans the whole grid
    scale = 2.0 ** -torch.randint(2, 8, (out, inp // g), generator=gen).float()  # powers of two: exact products
    zero = torch.randint(-64, 64, (out, inp // g), generator=gen).float() / 16
    w = (q.float().view(out, -1, g) * scale[..., None] + zero[..., None]).view(out, inp)
    errors = impl.quantization_error(w, [g, 2 * g])
    assert errors[g] < 1e-6, f"w already on the int4 grid of group {g} must come back exactly, error {errors[g]:.3g}"
    assert errors[2 * g] > 1e-3, f"groups of {2 * g} straddle two grids and lose something, error {errors[2 * g]:.3g}"
