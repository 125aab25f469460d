"""Chapter 6 — fused dequantize-matmul in Triton: `x @ W.T` with W stored as int8 or int4, decoded tile by tile
in registers.

A decode step reads every weight once and does two FLOPs per weight per token, so its time is the time to
read the weights. Stored as int8 (per output channel) or int4 (groups along K with a zero point, two values
per byte), they are about 2x or 3-3.5x fewer bytes than bf16 -- as long as the product reads those bytes, never
a dequantized copy. Here each program loads a tile of the small integers, turns it into x's dtype in
registers and feeds `tl.dot`, accumulating in float32; the weight crosses HBM once, in its stored form.

int8: the scale is per output row, so it factors out of the sum over K and multiplies the finished tile.
int4: byte i of a row holds elements 2i (low nibble) and 2i + 1 (high). A K step loads BLOCK_K / 2 bytes and
one scale and zero per group it spans, dequantizes both nibbles and interleaves them back into K order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import dot_precision, interpreting

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile (row, column); consecutive programs go down GROUP_M tiles of one column,
    so in a prefill they read the same weight tile while it is in L2."""
    pid, tiles_n = tl.program_id(0), tl.cdiv(N, BLOCK_N)
    return tl.swizzle2d(pid // tiles_n, pid % tiles_n, tl.cdiv(M, BLOCK_M), tiles_n, GROUP_M)


# M (the number of tokens) changes at every step; tune_rows only buckets it for the autotuner
@triton.jit(do_not_specialize=["M", "tune_rows"])
def _int8_kernel(X, Q, S, C, tune_rows, M, N, K, stride_xm, stride_xk, stride_qn, stride_qk, stride_s,
                 stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    q_ptrs = Q + offs_k[:, None] * stride_qk + offs_n[None, :] * stride_qn  # W.T's tile: [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = offs_k + k < K
        x = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
        q = tl.load(q_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0)
        if UPCAST:  # the interpreter multiplies in numpy, which has no bfloat16
            x = x.to(tl.float32)
        acc = tl.dot(x, q.to(x.dtype), acc, input_precision=DOT_PRECISION)  # -127..127: exact in any float type
        x_ptrs += BLOCK_K * stride_xk
        q_ptrs += BLOCK_K * stride_qk
    acc *= tl.load(S + offs_n * stride_s, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = C + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["M", "tune_rows"])
def _int4_kernel(X, P, S, Z, C, tune_rows, M, N, K, num_groups, stride_xm, stride_xk, stride_pn, stride_pk,
                 stride_sn, stride_sg, stride_cm, stride_cn, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    # a K step spans GROUPS groups of SPAN bytes per row (one group, or part of one, when groups are longer)
    GROUPS: tl.constexpr = (BLOCK_K + GROUP_SIZE - 1) // GROUP_SIZE
    SPAN: tl.constexpr = BLOCK_K // 2 // GROUPS
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, BLOCK_K // 2)  # bytes of a row in one K step
    offs_g = tl.arange(0, GROUPS)
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    p_ptrs = P + offs_n[:, None] * stride_pn + offs_b[None, :] * stride_pk  # [BLOCK_N, BLOCK_K / 2] bytes
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] + k < K), other=0.0)
        packed = tl.load(p_ptrs, mask=(offs_n[:, None] < N) & (offs_b[None, :] + k // 2 < K // 2), other=0)
        group = k // GROUP_SIZE + offs_g
        sz_offs = offs_n[:, None] * stride_sn + group[None, :] * stride_sg
        sz_mask = (offs_n[:, None] < N) & (group[None, :] < num_groups)
        scale = tl.load(S + sz_offs, mask=sz_mask, other=0.0).to(tl.float32)  # [BLOCK_N, GROUPS]
        zero = tl.load(Z + sz_offs, mask=sz_mask, other=0.0).to(tl.float32)
        # each group's scale and zero repeated over its bytes: [BLOCK_N, BLOCK_K / 2]
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, GROUPS, SPAN)), (BLOCK_N, BLOCK_K // 2))
        zero = tl.reshape(tl.broadcast_to(zero[:, :, None], (BLOCK_N, GROUPS, SPAN)), (BLOCK_N, BLOCK_K // 2))
        if UPCAST:  # the interpreter multiplies in numpy, which has no bfloat16
            x = x.to(tl.float32)
        low = ((packed & 0xF).to(tl.float32) * scale + zero).to(x.dtype)  # elements 2b
        high = ((packed >> 4).to(tl.float32) * scale + zero).to(x.dtype)  # elements 2b + 1
        w = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))  # side by side again: the weight tile in K order
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        p_ptrs += (BLOCK_K // 2) * stride_pk
    c_ptrs = C + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# Tiles. Decode (M <= 64 tokens) is bandwidth-bound: a BLOCK_M of 16, 32 or 64 rows covers the tokens in one
# tile, so each weight tile is read by one program; narrow BLOCK_N gives enough programs to keep every SM
# streaming, and long BLOCK_K steps read whole 128-byte lines of each weight row. Prefill is compute-bound:
# 64- and 128-row tiles, as in any GEMM. Weights of 1M+ elements are autotuned once per (N, K, dtypes,
# `tune_rows`: the power of two above M) among three candidates; smaller weights, float32 activations and
# the interpreter take a fixed tile, which costs one compilation and no tuning.
DECODE_TILES = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=4, num_stages=s)
                for n, k, s in [(16, 256, 4), (32, 256, 3), (64, 128, 3)]]
PREFILL_TILES = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": 64}, num_warps=w, num_stages=s)
                 for m, n, w, s in [(128, 128, 8, 3), (128, 64, 4, 4), (64, 128, 4, 4)]]
DECODE_FIXED = dict(BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=3)  # small N: as many programs as can be
PREFILL_FIXED = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
INTERPRETER_TILE = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64)  # small tiles: test shapes still span several
DECODE_ROWS = 64  # up to this many tokens, one tile of rows holds them all
AUTOTUNE_WEIGHTS = 1 << 20  # weights (N x K) from which a launch is autotuned


def _tuned(kernel) -> tuple:
    """(decode, prefill) autotuned launchers of `kernel`."""
    return (triton.autotune(DECODE_TILES, key=["N", "K", "tune_rows"])(kernel),
            triton.autotune(PREFILL_TILES, key=["N", "K", "tune_rows"])(kernel))


_INT8_TUNED, _INT4_TUNED = _tuned(_int8_kernel), _tuned(_int4_kernel)


def _launch(kernel, tuned: tuple, tensors: tuple, sizes: tuple, strides: tuple, x_dtype: torch.dtype,
            **consts) -> None:
    """Run `kernel` over the [M, N] output (sizes start M, N, K) with tiles chosen for the shape (see above)."""
    M, N, K = sizes[:3]
    tune_rows = max(16, min(triton.next_power_of_2(M), 4096))  # for decode: the BLOCK_M that covers M
    args = (*tensors, tune_rows, *sizes, *strides)
    consts.update(GROUP_M=8, UPCAST=interpreting(), DOT_PRECISION=dot_precision(x_dtype))
    fixed = N * K < AUTOTUNE_WEIGHTS or x_dtype == torch.float32

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    if interpreting():
        kernel[grid](*args, **consts, **INTERPRETER_TILE)
    elif M <= DECODE_ROWS and fixed:
        kernel[grid](*args, **consts, BLOCK_M=tune_rows, **DECODE_FIXED)
    elif M <= DECODE_ROWS:
        tuned[0][grid](*args, **consts, BLOCK_M=tune_rows)
    elif fixed:
        kernel[grid](*args, **consts, **PREFILL_FIXED)
    else:
        tuned[1][grid](*args, **consts)


def _check(x: torch.Tensor, K: int, weight: tuple[str, torch.Tensor],
           params: dict[str, tuple[torch.Tensor, tuple[int, ...]]]) -> None:
    """x must be [M, K] in an activation dtype; each of `params` a float tensor of its shape; all on x's device."""
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must be [M, K={K}] to match {weight[0]} {tuple(weight[1].shape)}; got {tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32; got {x.dtype}")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"x is on {x.device}: compiled Triton kernels need CUDA tensors")
    for name, (t, shape) in params.items():
        if tuple(t.shape) != shape or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor of shape {shape}; got {tuple(t.shape)} {t.dtype}")
    for name, t in [weight, *((name, t) for name, (t, _) in params.items())]:
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x [M, K] @ (q * scale[:, None]).T` in x's dtype, for q int8 `[N, K]` and one scale per row `[N]`
    (`minillm.quant_formats.quantize_int8`'s layout); any strides."""
    if q.dim() != 2 or q.dtype != torch.int8:
        raise ValueError(f"q must be an int8 tensor [N, K]; got {tuple(q.shape)} {q.dtype}")
    N, K = q.shape
    _check(x, K, ("q", q), {"scale": (scale, (N,))})
    out = torch.empty((x.shape[0], N), dtype=x.dtype, device=x.device)
    if out.numel():
        _launch(_int8_kernel, _INT8_TUNED, (x, q, scale, out), (x.shape[0], N, K),
                (*x.stride(), *q.stride(), scale.stride(0), *out.stride()), x.dtype)
    return out


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """`x [M, K] @ W.T` in x's dtype, for W `[N, K]` with `W[n, k] = q[n, k] * scale[n, g] + zero[n, g]`,
    g = k // group_size: `packed` uint8 `[N, K / 2]` holds q as `minillm.quant_formats.pack_int4` lays it out, scale
    and zero are `[N, K / group_size]` (`quantize_int4`'s layout). group_size: a power of two dividing K.
    Scales and zeros of any float dtype work; float32 ones can be prefetched with the weights (asynchronous
    copies move 4 bytes or more), while the few bfloat16 ones a K step needs are loaded as it runs."""
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be a uint8 tensor [N, K / 2]; got {tuple(packed.shape)} {packed.dtype}")
    N, K = packed.shape[0], 2 * packed.shape[1]
    if group_size < 2 or group_size & (group_size - 1) or K % group_size:
        raise ValueError(f"group size {group_size} must be a power of two dividing K = {K} "
                         f"(2 x packed's {K // 2} columns)")
    shape = (N, K // group_size)
    _check(x, K, ("packed", packed), {"scale": (scale, shape), "zero": (zero, shape)})
    scale, zero = scale.contiguous(), zero.contiguous()  # one set of strides serves both
    out = torch.empty((x.shape[0], N), dtype=x.dtype, device=x.device)
    if out.numel():
        _launch(_int4_kernel, _INT4_TUNED, (x, packed, scale, zero, out), (x.shape[0], N, K, K // group_size),
                (*x.stride(), *packed.stride(), *scale.stride(), *out.stride()), x.dtype, GROUP_SIZE=group_size)
    return out
