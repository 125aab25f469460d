"""Weight-only quantization formats on random tensors: exact packing, error bounds, kernels against references."""

import pytest
import torch

from minillm import quant

SHAPES = [(64, 128), (96, 256), (8, 64)]


def weight(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_round_trip_within_half_a_step(shape):
    w = weight(shape)
    q, scale = quant.quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert ((quant.dequantize_int8(q, scale) - w).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_round_trip_within_half_a_step(shape, group_size):
    w = weight(shape, seed=group_size)
    q, scale, zero = quant.quantize_int4(w, group_size)
    assert q.dtype == torch.uint8 and q.max() <= 15
    error = (quant.dequantize_int4(q, scale, zero) - w).abs().view(shape[0], -1, group_size)
    assert (error <= scale[..., None] / 2 + 1e-7).all()
    # each group's minimum and maximum are on the grid: 0 and 15
    assert (q.view(shape[0], -1, group_size).amin(-1) == 0).all()


def test_pack_int4_is_exact_and_two_per_byte():
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = quant.pack_int4(q)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert torch.equal(quant.unpack_int4(packed), q)
    assert int(packed[0, 0]) == int(q[0, 0]) | int(q[0, 1]) << 4


def test_fp8_relative_error():
    w = weight((64, 128))
    q, scale = quant.quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn
    back = quant.dequantize_fp8(q, scale)
    normal = w.abs() > scale[:, None] * 2 ** -6  # e4m3's normal range (3 mantissa bits: relative step 1/8)
    assert ((back - w).abs()[normal] <= w.abs()[normal] / 16 + 1e-9).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_dequantized_products(dtype):
    w, x = weight((96, 256), seed=3), torch.randn(5, 256)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    q, scale = quant.quantize_int8(w)
    expected = x.to(dtype).float() @ quant.dequantize_int8(q, scale.to(dtype).float()).T
    torch.testing.assert_close(quant.int8_linear(x.to(dtype), q, scale).float(), expected, **tol)
    q4, s4, z4 = quant.quantize_int4(w, 64)
    packed, scales_and_zeros = quant.to_int4pack(q4, s4, z4)
    expected = x.to(dtype).float() @ quant.dequantize_int4(q4, s4, z4).T
    torch.testing.assert_close(quant.int4_linear(x.to(dtype), packed, scales_and_zeros, 64).float(), expected, **tol)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="group size 48"):
        quant.quantize_int4(weight((8, 64)), 48)
    with pytest.raises(ValueError, match="2-D"):
        quant.quantize_int8(torch.randn(3, 4, 5))
    with pytest.raises(ValueError, match="even"):
        quant.pack_int4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 16 output rows"):
        quant.to_int4pack(*quant.quantize_int4(weight((8, 64)), 32))
    q4, s4, z4 = quant.quantize_int4(weight((16, 64)), 16)
    with pytest.raises(ValueError, match="int4 kernel"):
        quant.int4_linear(torch.randn(1, 64), *quant.to_int4pack(q4, s4, z4), 16)
