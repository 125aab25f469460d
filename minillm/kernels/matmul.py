"""Chapter 5 — a tiled matrix multiply in Triton: the skeleton of every cuBLAS/CUTLASS GEMM, in about forty lines.

C = A @ B is cut into BLOCK_M x BLOCK_N output tiles, one program each. A program walks the shared K
dimension BLOCK_K at a time, loading a tile of A and a tile of B into on-chip memory and accumulating their
product in float32 registers; C's tile is written to HBM once, at the end. Masks cover the ragged edges
when a size is not a multiple of the tile. Programs are numbered so that neighbours share tiles of A
("grouped ordering"), which lets the L2 cache serve repeated reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import dot_precision, interpreting


@triton.jit
def _matmul_kernel(A, B, C, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Which output tile: program ids run down a column of GROUP_M tiles before moving right.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
    pid_n = (pid % (GROUP_M * tiles_n)) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):  # stream the K dimension through on-chip memory
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] + k < K), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] + k < K) & (offs_n[None, :] < N), other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = C + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def matmul(a: torch.Tensor, b: torch.Tensor, block_m: int | None = None, block_n: int | None = None,
           block_k: int | None = None, group_m: int = 8) -> torch.Tensor:
    """`a [M, K] @ b [K, N]` in a's dtype, accumulated in float32; tile sizes default to 16 in the interpreter
    and 128 x 128 x 32 on a GPU."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul needs [M, K] @ [K, N]; got {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"a and b must share dtype and device; got {a.dtype}/{a.device}, {b.dtype}/{b.device}")
    default = (16, 16, 16) if interpreting() else (128, 128, 32)
    bm, bn, bk = block_m or default[0], block_n or default[1], block_k or default[2]
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _matmul_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
                         c.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, UPCAST=interpreting(),
                         DOT_PRECISION=dot_precision(a.dtype), num_warps=8 if bm * bn >= 128 * 128 else 4)
    return c
