"""minillm.kernels.int4_cpu: the C int4 and int8 products against float64 references, PyTorch's int4 and int8
kernels, and themselves built for each instruction set this machine runs (AVX512-VNNI, AVX2, plain C)."""

from __future__ import annotations

import ctypes
import functools
import platform

import pytest
import torch

from minillm.kernels import cpu, int4_cpu
from minillm.kernels.int4_cpu import (Int4Weight, Int8Weight, int4_cpu_amx, int4_cpu_available, int4_cpu_isa,
                                     int4_matmul_cpu, int8_matmul_cpu, matmul_unchecked, pack_int4_cpu, pack_int8_cpu)
from minillm.quant import int4_linear, int8_linear, to_int4pack
from minillm.quant_formats import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

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


@functools.cache
def case8(n: int, k: int, group: int | None = None, seed: int = 0) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                                            Int8Weight]:
    """int8 weights with a scale per row, or per `group` inputs."""
    gen = torch.Generator().manual_seed(seed)
    qs = quantize_int8(torch.randn(n, k, generator=gen) * 0.05 + 0.01, group_size=group)
    return qs, pack_int8_cpu(*qs)


def full_range8(n: int, k: int) -> tuple[tuple[torch.Tensor, torch.Tensor], Int8Weight]:
    """Codes drawn from all of -128..127, with long runs of the extremes: the largest integer sums there are."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    q[0], q[1, : k // 2], q[1, k // 2:] = -128, 127, -128
    scale = torch.rand(n, generator=gen) * 1e-3 + 1e-4
    return (q, scale), pack_int8_cpu(q, scale)


def activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 per block of 32 as the kernel does (one step amax / 127 a block), in float64."""
    m, k = x.shape
    blocks = x.double().view(m, -1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / step.clamp(min=1e-300)) * step).view(m, k)


def emulate(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The int4 kernel's arithmetic in float64: x rounded to int8 per block of 32, the codes centred on 7.5
    against the rounding error (the centring term uses x's exact group sums), scales and zeros in float16."""
    k = x.shape[1]
    rounded = rounded_activations(x)
    s, z = (t.half().double().repeat_interleave(k // t.shape[1], dim=1) for t in (scale, zero))
    return rounded @ ((q.double() - 7.5) * s).T + x.double() @ (z + 7.5 * s).T


def emulate8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The int8 kernel's arithmetic in float64: x rounded to int8 per block of 32, the weight exactly q * scale
    (the integer sums are exact, float32 scales are kept as they are), a scale per row or per group."""
    return rounded_activations(x) @ dequantize_int8(q.double(), scale.double()).T


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


def check_residual_and_out(matmul, x, w, residual, atol):
    """`matmul(x, w)` with a residual added, into a given `out`, and in place into the residual itself (the
    engine's residual stream, updated where it lies) all equal the plain product; returns the plain product."""
    plain = matmul(x, w)
    torch.testing.assert_close(matmul(x, w, residual=residual), plain + residual, rtol=0, atol=atol)
    out = torch.full(plain.shape, float("nan"))
    assert matmul(x, w, out=out) is out
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    in_place = residual.clone()
    matmul(x, w, residual=in_place, out=in_place)
    torch.testing.assert_close(in_place, plain + residual, rtol=0, atol=atol)
    return plain


def test_residual_and_out():
    _, w = case(40, 576, 32)
    check_residual_and_out(int4_matmul_cpu, activations(5, 576), w, activations(5, 40, seed=2), atol=1e-6)


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


def test_amx_changes_no_bit():
    """Where the products take whole groups of 16 rows to AMX tiles, turning that off (the AVX512-VNNI loop) changes
    no output bit: int4 (groups of 32, 64 and 128) and int8 (a scale per row, per 32), with and without a residual,
    at row counts around and across the groups of 16, on one thread and two."""
    if not int4_cpu_amx():
        pytest.skip("no AMX here (the CPU, the build or Linux)")
    threads = torch.get_num_threads()
    try:
        for m, n, k, group in [(16, 40, 576, 32), (17, 1000, 576, 32), (33, 16, 1536, 64), (100, 40, 128, 128)]:
            for matmul, w in ((int4_matmul_cpu, case(n, k, group)[1]), (int8_matmul_cpu, case8(n, k)[1]),
                              (int8_matmul_cpu, case8(n, k, 32)[1])):
                x, residual = activations(m, k), activations(m, n, seed=2)
                for t in (1, 2):
                    torch.set_num_threads(t)
                    got = {}
                    for amx in (True, False):
                        int4_cpu_amx(amx)
                        got[amx] = (matmul(x, w), matmul(x, w, residual=residual))
                    assert all(torch.equal(a, b) for a, b in zip(got[True], got[False])), (m, n, k, group, t)
    finally:
        int4_cpu_amx(True)
        torch.set_num_threads(threads)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set flags")
@pytest.mark.parametrize("flags,isa", [(["-mno-avx512f"], "avx2"), (["-mno-avx2"], "scalar")])
def test_each_instruction_set(flags, isa, tmp_path, monkeypatch):
    """The same source built without AVX512 (the AVX2 path, where the CPU has it) and without AVX2 (plain C),
    int8 also with codes -128 and 127 in long runs, where AVX2's 16-bit pair sums come closest to saturating."""
    monkeypatch.setattr(cpu, "COMPILE_FLAGS", cpu.COMPILE_FLAGS + flags)
    lib = int4_cpu._declare(ctypes.CDLL(str(cpu._build(int4_cpu.SOURCE, tmp_path))))
    monkeypatch.setattr(int4_cpu, "_library", lambda: lib)
    if int4_cpu_isa() != isa:
        pytest.skip(f"this CPU builds {int4_cpu_isa()} with {flags}")
    for m, n, k, group in [(1, 40, 576, 32), (7, 16, 128, 64)]:
        (q, scale, zero), w = case(n, k, group)
        x, residual = activations(m, k), activations(m, n, seed=2)
        emulated = emulate(x, q, scale, zero) + residual.double()
        got = int4_matmul_cpu(x, w, residual=residual)
        assert (got.double() - emulated).abs().max().item() < TOL_EMULATED * emulated.abs().max().item()
    for m, n, k, group in [(1, 40, 576, None), (7, 16, 128, None), (5, 24, 1536, None), (3, 40, 576, 32),
                           (2, 16, 128, 64)]:
        (q, scale), w = case8(n, k, group) if n != 24 else full_range8(n, k)
        x, residual = activations(m, k), activations(m, n, seed=2)
        x[0] = x[0].abs()  # x's codes all positive: with the rows of -128 and 127, the largest sums
        emulated = emulate8(x, q, scale) + residual.double()
        got = int8_matmul_cpu(x, w, residual=residual)
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


# int8 weights, symmetric, a scale per output channel or per group of inputs (`quantize_int8`). The integer sums
# are exact and the scales kept in float32, so against the exact product only x's rounding to int8 is left:
# TOL_INT8_X, as for int4.
SHAPES8 = ([(m, n, 576, None) for m in (1, 3, 16, 100) for n in (16, 40, 1000)]
           + [(m, 40, k, None) for m in (1, 16) for k in (64, 1536)] + [(100, 1000, 1536, None), (1, 49152, 576, None)]
           + [(m, n, 576, 32) for m in (1, 16) for n in (40, 1000)]
           + [(m, 40, k, group) for m in (1, 5) for k, group in ((64, 32), (64, 64), (1536, 64), (1536, 512))]
           + [(100, 1000, 1536, 32)])


@pytest.mark.parametrize("m,n,k,group", SHAPES8)
def test_int8_matches_dequantized_product(m, n, k, group):
    (q, scale), w = case8(n, k, group)
    x = activations(m, k)
    got = int8_matmul_cpu(x, w)
    assert got.shape == (m, n) and got.dtype == torch.float32
    exact = x.double() @ dequantize_int8(q, scale).double().T
    assert relative_error(got, exact) < TOL_INT8_X
    emulated = emulate8(x, q, scale)
    assert (got.double() - emulated).abs().max().item() < TOL_EMULATED * emulated.abs().max().item()


def test_int8_full_code_range():
    """-128 (which `quantize_int8` never makes) is a valid code too, and runs of extremes do not overflow."""
    (q, scale), w = full_range8(40, 1536)
    x = activations(3, 1536).abs()
    emulated = emulate8(x, q, scale)
    got = int8_matmul_cpu(x, w)
    assert (got.double() - emulated).abs().max().item() < TOL_EMULATED * emulated.abs().max().item()


def test_int8_residual_out_and_threads():
    _, w = case8(1000, 576)
    x = activations(100, 576)
    plain = check_residual_and_out(int8_matmul_cpu, x, w, activations(100, 1000, seed=2), atol=1e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(int8_matmul_cpu(x, w), plain)
    finally:
        torch.set_num_threads(threads)


def test_agrees_with_torch_int8_kernel():
    """Same weights through PyTorch's `_weight_int8pack_mm` (bfloat16 activations and scales): its outputs are off
    the exact product by about 0.25 % (bfloat16 x), ours by about 0.5 % (int8 x), so the two differ by about 0.6 %
    (bound 2 %) and pick the same largest output in (almost) every row."""
    gen = torch.Generator().manual_seed(0)
    q, scale = quantize_int8(torch.randn(1000, 576, generator=gen) * 0.05, torch.bfloat16)  # scales exact in bf16
    x = activations(64, 576)
    theirs = int8_linear(x.to(torch.bfloat16), q, scale.to(torch.bfloat16)).float()
    ours = int8_matmul_cpu(x, pack_int8_cpu(q, scale))
    assert relative_error(ours, theirs.double()) < 2e-2
    assert (ours.argmax(1) == theirs.argmax(1)).float().mean() >= 0.95


def test_int8_packed_layout_and_size():
    (q, scale), w = case8(40, 576)
    assert (w.out_features, w.in_features) == (40, 576)
    assert w.q.shape == (3, 144, 16, 4) and w.q.dtype == torch.int8 and w.scale.shape == (3, 1, 16)
    assert torch.equal(w.q[1, 2, 5], q[21, 8:12]) and w.scale[2, 0, 7] == scale[39] and w.scale[2, 0, 8] == 0
    assert w.group_size == 576 and w.nbytes == 48 * (576 + 4)  # rows padded to 48: 1 byte a weight, 4 bytes a row
    (q, scale), w = case8(40, 576, 32)
    assert w.scale.shape == (3, 18, 16) and w.scale[2, 5, 7] == scale[39, 5] and w.group_size == 32
    assert w.nbytes == 48 * (576 + 4 * 18)  # and 4 bytes a group of 32


def test_matmul_unchecked_matches_checked_calls():
    _, w4 = case(40, 576, 32)
    _, w8 = case8(40, 576)
    x, residual = activations(3, 576), activations(3, 40, seed=2)
    for w, checked in ((w4, int4_matmul_cpu), (w8, int8_matmul_cpu)):
        out = torch.empty(3, 40)
        assert matmul_unchecked(x, w, None, out) is out
        assert torch.equal(out, checked(x, w))
        in_place = residual.clone()
        matmul_unchecked(x, w, in_place, in_place)
        assert torch.equal(in_place, checked(x, w, residual=residual))


def test_int8_bad_inputs():
    (q, scale), w = case8(40, 576)
    x = activations(2, 576)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int8_cpu(q[:, :48], scale)
    with pytest.raises(ValueError, match="int8"):
        pack_int8_cpu(q.to(torch.int32), scale)
    with pytest.raises(ValueError, match="scale"):
        pack_int8_cpu(q, scale[:-1])
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int8_cpu(*quantize_int8(torch.randn(40, 576), group_size=16))  # groups the blocks of x would split
    with pytest.raises(ValueError, match="float32"):
        int8_matmul_cpu(x.to(torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"\[M, 576\]"):
        int8_matmul_cpu(x[:, :64], w)
    with pytest.raises(ValueError, match="residual"):
        int8_matmul_cpu(x, w, residual=torch.zeros(2, 41))
    with pytest.raises(ValueError, match="out"):
        int8_matmul_cpu(x, w, out=torch.zeros(40, 2).T)
