"""minillm.kernels.int8_matmul / int4_matmul: Triton products with quantized weights against plain PyTorch references.

On a CPU the kernels run in Triton's interpreter (minillm.kernels sets TRITON_INTERPRET=1 before triton is
imported), so shapes stay small; on a GPU the same tests run the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

import minillm.kernels as K  # first: on a CPU it sets TRITON_INTERPRET=1 before anything imports triton
from minillm.kernels import reference as ref
from minillm.quant import int4_linear, int8_linear, to_int4pack
from minillm.quant_formats import pack_int4, quantize_int4, quantize_int8

pytest.importorskip("triton", reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# error allowed, relative to the largest output: the kernels round the dequantized weight to x's dtype
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def close(out: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert out.dtype == want.dtype and out.shape == want.shape, what
    tol = TOL[want.dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=tol * want.float().abs().max().item(), rtol=tol,
                               msg=lambda m: f"{what}: {m}")


def weights_int8(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = quantize_int8(torch.randn(n, k, generator=gen))
    return q.to(DEVICE), scale.to(DEVICE)


def weights_int4(n: int, k: int, group: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    q, scale, zero = quantize_int4(torch.randn(n, k, generator=gen), group)
    return pack_int4(q).to(DEVICE), scale.to(DEVICE), zero.to(DEVICE)


def activations(m: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(m, k, generator=gen).to(dtype=dtype, device=DEVICE)


# (M, N, K): one token, a decode batch, a prefill-sized M; N and K off the tiles (odd where the format allows)
INT8_SHAPES = [(1, 1, 1), (1, 37, 70), (16, 16, 64), (33, 50, 23), (70, 24, 101)]
INT4_SHAPES = [(1, 17, 128), (16, 32, 256), (33, 24, 384), (70, 9, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mnk", INT8_SHAPES, ids=lambda s: "m{}_n{}_k{}".format(*s))
def test_int8_matches_reference(mnk, dtype):
    m, n, k = mnk
    gen = torch.Generator().manual_seed(m + n + k)
    q, scale = weights_int8(n, k, gen)
    x = activations(m, k, dtype, gen)
    close(K.int8_matmul(x, q, scale), ref.int8_matmul_ref(x, q, scale), f"int8 {mnk} {dtype}")


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("mnk", INT4_SHAPES, ids=lambda s: "m{}_n{}_k{}".format(*s))
def test_int4_matches_reference(mnk, group):
    m, n, k = mnk
    gen = torch.Generator().manual_seed(m + n + k + group)
    packed, scale, zero = weights_int4(n, k, group, gen)
    for dtype in (torch.float32, torch.bfloat16):
        x = activations(m, k, dtype, gen)
        close(K.int4_matmul(x, packed, scale, zero, group), ref.int4_matmul_ref(x, packed, scale, zero, group),
              f"int4 {mnk} G={group} {dtype}")


def test_int4_half_precision_scales():
    """fp16 activations, and scales and zeros stored in bfloat16 (half the bytes of float32 ones)."""
    gen = torch.Generator().manual_seed(1)
    packed, scale, zero = weights_int4(40, 192, 64, gen)
    scale, zero = scale.to(torch.bfloat16), zero.to(torch.bfloat16)
    x = activations(5, 192, torch.float16, gen)
    close(K.int4_matmul(x, packed, scale, zero, 64), ref.int4_matmul_ref(x, packed, scale, zero, 64), "int4 fp16")


@pytest.mark.skipif(DEVICE == "cpu", reason="the interpreter runs one fixed tile; this checks the tuned GPU ones")
@pytest.mark.parametrize("m", [5, 300], ids=["decode", "prefill"])
def test_autotuned_tiles(m):
    """Weights of 1M+ elements take the autotuned decode and prefill tiles."""
    gen = torch.Generator().manual_seed(m)
    x = activations(m, 1536, torch.bfloat16, gen)
    q, scale = weights_int8(1000, 1536, gen)
    close(K.int8_matmul(x, q, scale), ref.int8_matmul_ref(x, q, scale), f"int8 tuned M={m}")
    packed, scale4, zero4 = weights_int4(1000, 1536, 64, gen)
    close(K.int4_matmul(x, packed, scale4, zero4, 64), ref.int4_matmul_ref(x, packed, scale4, zero4, 64),
          f"int4 tuned M={m}")


def test_strided_inputs():
    gen = torch.Generator().manual_seed(2)
    x = activations(96, 20, torch.float32, gen).T  # [20, 96], a transposed view
    q, scale = weights_int8(30, 192, gen)
    q = q[:, ::2]  # every other column: a row stride of 192 for 96 columns
    close(K.int8_matmul(x, q, scale), ref.int8_matmul_ref(x, q, scale), "int8 strided")
    packed, scale4, zero4 = weights_int4(30, 96, 32, gen)
    scale4, zero4 = scale4.T.contiguous().T, zero4.T.contiguous().T  # column-major scales
    close(K.int4_matmul(x, packed, scale4, zero4, 32), ref.int4_matmul_ref(x, packed, scale4, zero4, 32),
          "int4 strided")


def test_no_tokens():
    q, scale = weights_int8(8, 32, torch.Generator().manual_seed(3))
    out = K.int8_matmul(torch.zeros(0, 32, device=DEVICE), q, scale)
    assert out.shape == (0, 8) and out.dtype == torch.float32


def test_same_numbers_as_the_cpu_kernels():
    """The GPU layouts (q with a scale; pack_int4 bytes with scale and zero) give what PyTorch's packed CPU
    kernels give for the same quantized weight, so a model answers alike on either device."""
    gen = torch.Generator().manual_seed(4)
    w, x = torch.randn(32, 128, generator=gen), torch.randn(3, 128, generator=gen).to(torch.bfloat16)
    q, scale = quantize_int8(w)
    cpu = int8_linear(x, q, scale.to(torch.bfloat16))
    close(K.int8_matmul(x.to(DEVICE), q.to(DEVICE), scale.to(torch.bfloat16).to(DEVICE)).cpu(), cpu, "int8")
    q4, scale4, zero4 = quantize_int4(w, 32)
    cpu = int4_linear(x, *to_int4pack(q4, scale4, zero4), 32)
    close(K.int4_matmul(x.to(DEVICE), pack_int4(q4).to(DEVICE), scale4.to(DEVICE), zero4.to(DEVICE), 32).cpu(), cpu,
          "int4")


def test_errors_at_the_boundary():
    gen = torch.Generator().manual_seed(5)
    q, scale = weights_int8(8, 64, gen)
    packed, scale4, zero4 = weights_int4(8, 64, 32, gen)
    x = activations(2, 64, torch.float32, gen)
    with pytest.raises(ValueError, match="int8"):
        K.int8_matmul(x, q.float(), scale)
    with pytest.raises(ValueError, match=r"x must be \[M, K=64\]"):
        K.int8_matmul(x[:, :63], q, scale)
    with pytest.raises(ValueError, match=r"x must be \[M, K=64\]"):
        K.int8_matmul(x[None], q, scale)
    with pytest.raises(ValueError, match="bfloat16"):
        K.int8_matmul(x.to(torch.int32), q, scale)
    with pytest.raises(ValueError, match="scale"):
        K.int8_matmul(x, q, scale[:7])
    with pytest.raises(ValueError, match="uint8"):
        K.int4_matmul(x, packed.to(torch.int8), scale4, zero4, 32)
    for group in (128, 48, 1):  # too long for K, not a power of two, not even
        with pytest.raises(ValueError, match="power of two dividing K = 64"):
            K.int4_matmul(x, packed, scale4, zero4, group)
    with pytest.raises(ValueError, match="zero"):
        K.int4_matmul(x, packed, scale4, zero4[:, :1], 32)
    with pytest.raises(ValueError, match="scale"):
        K.int4_matmul(x, packed, scale4, zero4, 64)  # right group size for K, wrong for these scales
    with pytest.raises(ValueError, match="do not cover"):
        ref.int4_matmul_ref(x, packed, scale4, zero4, 64)
