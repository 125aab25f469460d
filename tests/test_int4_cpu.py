"""minillm.kernels.int4_cpu: the C int4 product against float64 references, PyTorch's int4 kernel, and itself
built for each instruction set this machine runs (AVX512-VNNI, AVX2, plain C)."""

from __future__ import annotations

import functools
import platform

import pytest
import torch

from minillm.kernels import cpu, int4_cpu
from minillm.kernels.int4_cpu import Int4Weight, int4_cpu_available, int4_cpu_isa, int4_matmul_cpu, pack_int4_cpu
from minillm.quant import dequantize_int4, int4_linear, quantize_int4, to_int4pack

pytestmark = pytest.mark.skipif(not int4_cpu_available(), reason="no C compiler to build the kernel with")

# Error bound, relative to the output's norm, against the exact product with the float weights: x is rounded to
# int8 per block of 32 (a step of amax / 127, so about 0.5 % of x's scale for normal activations, measured 0.4 to
# 0.7 % here) and the scales and zeros to float16 (about 0.07 %); 1e-2 leaves room for neither to double.
TOL_INT8_X = 1e-2
# Against a float64 emulation of the kernel's own rounding (int8 x, centred codes, float16 scales), relative to
# the largest output: what is left is float32 accumulation (measured up to 5e-7) and the rare element of x whose
# float32 rounding lands on the other side of a half step.
TOL_EMULATED = 1e-5


@functools.cache
def case(n: int, k: int, group: int, seed: int = 0) -> tuple[tuple[torch.Tensor, ...], Int4Weight]:
    gen = torch.Generator().manual_seed(seed)
    qsz = quantize_int4(torch.randn(n, k, generator=gen) * 0.05 + 0.01, group)
    return qsz, pack_int4_cpu(*qsz, group)


def activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def emulate(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: x rounded to int8 per block of 32, the codes centred on 7.5 against
    the rounding error (the centring term uses x's exact group sums), scales and zeros in float16."""
    m, k = x.shape
    blocks = x.double().view(m, -1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    rounded = (torch.round(blocks / step.clamp(min=1e-300)) * step).view(m, k)
    s, z = (t.half().double().repeat_interleave(k // t.shape[1], dim=1) for t in (scale, zero))
    return rounded @ ((q.double() - 7.5) * s).T + x.double() @ (z + 7.5 * s).T


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


SHAPES = ([(m, n, 576, 32) for m in (1, 3, 16, 100) for n in (16, 40, 576, 1000)]  # every batch and width
          + [(m, 40, k, group) for m in (1, 16) for k, group in ((64, 32), (64, 64), (576, 64), (1536, 32), (1536, 64))]
          + [(100, 1000, 1536, 64)])


@pytest.mark.parametrize("m,n,k,group", SHAPES)
def test_matches_dequantized_product(m, n, k, group):
    (q, scale, zero), w = case(n, k, group)
    x = activations(m, k)
    got = int4_matmul_cpu(x, w)
    assert got.shape == (m, n) and got.dtype == torch.float32
    exact = x.double() @ dequantize_int4(q, scale, zero).double().T
    assert relative_error(got, exact) < TOL_INT8_X
    emulated = emulate(x, q, scale, zero)
    assert (got.double() - emulated).abs().max().item() < TOL_EMULATED * emulated.abs().max().item()


def test_residual_and_out():
    (q, scale, zero), w = case(40, 576, 32)
    x, residual = activations(5, 576), activations(5, 40, seed=2)
    plain = int4_matmul_cpu(x, w)
    torch.testing.assert_close(int4_matmul_cpu(x, w, residual=residual), plain + residual, rtol=0, atol=1e-6)
    out = torch.full((5, 40), float("nan"))
    assert int4_matmul_cpu(x, w, out=out) is out
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    in_place = residual.clone()  # the engine's residual stream, updated where it lies
    int4_matmul_cpu(x, w, residual=in_place, out=in_place)
    torch.testing.assert_close(in_place, plain + residual, rtol=0, atol=1e-6)


def test_threads_split_rows_without_changing_results():
    _, w = case(1000, 576, 32)
    x = activations(100, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int4_matmul_cpu(x, w)
        torch.set_num_threads(2)
        two = int4_matmul_cpu(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # every output is summed by one thread in the same order


def test_agrees_with_torch_int4_kernel():
    """Same weights through PyTorch's `_weight_int4pack_mm_for_cpu` (bfloat16 activations): nearly parallel
    outputs, and the same largest output in (almost) every row of a wide product."""
    (q, scale, zero), w = case(1024, 576, 32)  # PyTorch's kernel takes multiples of 16 rows
    x = activations(64, 576)
    packed, scales_and_zeros = to_int4pack(q, scale, zero)
    theirs = int4_linear(x.to(torch.bfloat16), packed, scales_and_zeros, 32).float()
    ours = int4_matmul_cpu(x, w)
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=1).min() > 0.999
    assert (ours.argmax(1) == theirs.argmax(1)).float().mean() >= 0.95


def test_packed_layout_and_size():
    (q, scale, zero), w = case(40, 576, 64)
    assert (w.out_features, w.in_features, w.group_size) == (40, 576, 64)
    assert w.q.shape == (3, 72, 16, 4) and w.scale.shape == w.zero.shape == (3, 9, 16)
    assert w.nbytes == 48 * (576 // 2 + 4 * 576 // 64)  # rows padded to 48: 1/2 byte a weight, 4 bytes a group
    assert int4_cpu_isa() in ("avx512vnni", "avx2", "scalar")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set flags")
@pytest.mark.parametrize("flags,isa", [(["-mno-avx512f"], "avx2"), (["-mno-avx2"], "scalar")])
def test_each_instruction_set(flags, isa, tmp_path, monkeypatch):
    """The same source built without AVX512 (the AVX2 path, where the CPU has it) and without AVX2 (plain C)."""
    monkeypatch.setattr(cpu, "COMPILE_FLAGS", cpu.COMPILE_FLAGS + flags)
    lib = int4_cpu._load(cpu._build(int4_cpu.SOURCE, tmp_path))
    monkeypatch.setattr(int4_cpu, "_library", lambda: lib)
    if int4_cpu_isa() != isa:
        pytest.skip(f"this CPU builds {int4_cpu_isa()} with {flags}")
    for m, n, k, group in [(1, 40, 576, 32), (7, 16, 128, 64)]:
        (q, scale, zero), w = case(n, k, group)
        x, residual = activations(m, k), activations(m, n, seed=2)
        emulated = emulate(x, q, scale, zero) + residual.double()
        got = int4_matmul_cpu(x, w, residual=residual)
        assert (got.double() - emulated).abs().max().item() < TOL_EMULATED * emulated.abs().max().item()


def test_bad_inputs():
    (q, scale, zero), w = case(40, 576, 32)
    x = activations(2, 576)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int4_cpu(q, scale, zero, 48)
    with pytest.raises(ValueError, match="dividing"):
        pack_int4_cpu(q[:, :96], scale[:, :1], zero[:, :1], 64)  # 96 inputs, groups of 64
    with pytest.raises(ValueError, match="uint8"):
        pack_int4_cpu(q.to(torch.int32), scale, zero, 32)
    with pytest.raises(ValueError, match="0..15"):
        pack_int4_cpu(q * 2, scale, zero, 32)
    with pytest.raises(ValueError, match="scale"):
        pack_int4_cpu(q, scale[:, :-1], zero, 32)
    with pytest.raises(ValueError, match="float16"):
        pack_int4_cpu(q, scale * 1e8, zero, 32)
    with pytest.raises(ValueError, match="float32"):
        int4_matmul_cpu(x.to(torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"\[M, 576\]"):
        int4_matmul_cpu(x[:, :64], w)
    with pytest.raises(ValueError, match="CPU"):
        int4_matmul_cpu(x.to("meta"), w)
    with pytest.raises(ValueError, match="residual"):
        int4_matmul_cpu(x, w, residual=torch.zeros(2, 41))
    with pytest.raises(ValueError, match="out"):
        int4_matmul_cpu(x, w, out=torch.zeros(40, 2).T)
