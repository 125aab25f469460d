"""minillm's Triton FlashAttention against PyTorch SDPA and naive attention, all timed in one run on one GPU.

Prefill: causal and full attention, bf16, head dim 64 and 128, N = 512 ... 8192 tokens per sequence (batch x N
fixed at 16k tokens, 2048 = heads x head_dim), in ms and TFLOP/s (4 N^2 d FLOPs per head, half when causal).
Naive attention is three PyTorch ops (QK^T, softmax, PV) that write the N x N matrix to HBM.
Decode: one query token per sequence against a paged cache (block size 16), ours against SDPA over the same
keys already gathered into a contiguous tensor, and against gather + SDPA (what a torch engine must do).
A tiled Triton matmul against cuBLAS (torch.matmul) closes the run. Times are medians of triton's do_bench.

    python benchmarks/attention.py [--quick]        (GPU only; on a CPU it says so and exits 0)
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET = 1.3  # ours within 1.3x of SDPA's time for causal prefill at N = 4096


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """[b, h, N, d] attention through the full score matrix: three kernels and two N x N tensors in HBM."""
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """A paged cache's blocks, in each sequence's order: `[b, kv_heads, context, d]`."""
    return cache[table.long()].flatten(1, 2).transpose(1, 2)


def gather_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Decode attention as a PyTorch engine does it: copy the blocks into one tensor, then SDPA."""
    return F.scaled_dot_product_attention(q, gather(k_cache, table), gather(v_cache, table), enable_gqa=True)


def bench(fn) -> float | None:
    """Median ms of fn, or None when it runs out of memory."""
    from triton.testing import do_bench

    try:
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def fmt(ms: float | None, flops: float) -> str:
    return f"{'OOM':>8} {'':>7}" if ms is None else f"{ms:8.3f} {flops / ms / 1e9:7.1f}"


def prefill(lengths: list[int], head_dims: list[int]) -> dict:
    from minillm.kernels import flash_attn_func

    ratios = {}
    print("\nprefill, bf16, batch x N = 16384 tokens, heads x head_dim = 2048 (ms, TFLOP/s)")
    print(f"{'causal':>6} {'d':>4} {'N':>5} {'b':>3} | {'ours':>16} | {'SDPA':>16} | {'naive':>16} | "
          f"{'ours/SDPA':>9} {'max|ours-SDPA|':>14}")
    for causal in (True, False):
        for d in head_dims:
            for n in lengths:
                b, h = max(1, 16384 // n), 2048 // d
                gen = torch.Generator(device="cuda").manual_seed(n + d)
                q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                           for _ in range(3))
                qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # SDPA's [b, h, N, d] layout
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                ours = bench(partial(flash_attn_func, q, k, v, causal=causal))
                sdpa = bench(partial(F.scaled_dot_product_attention, qt, kt, vt, is_causal=causal))
                naive = bench(partial(naive_attention, qt, kt, vt, causal))
                err = (flash_attn_func(q, k, v, causal=causal).transpose(1, 2)
                       - F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)).abs().max().item()
                ratios[(causal, d, n)] = ours / sdpa
                print(f"{causal!s:>6} {d:4d} {n:5d} {b:3d} | {fmt(ours, flops)} | {fmt(sdpa, flops)} | "
                      f"{fmt(naive, flops)} | {ours / sdpa:9.2f} {err:14.4f}")
    return ratios


def decode(batches: list[int], context: int, block_size: int = 16, h: int = 32, hk: int = 8, d: int = 128) -> None:
    from minillm.kernels import flash_attn_with_kvcache

    print(f"\npaged decode, bf16, context {context}, {h} query / {hk} kv heads, d={d}, block size {block_size} "
          f"(ms, GB/s of K/V read)")
    print(f"{'batch':>5} | {'ours':>8} {'GB/s':>7} | {'SDPA contiguous':>15} | {'gather + SDPA':>13} | "
          f"{'ours/SDPA':>9} {'max|err|':>9}")
    for b in batches:
        blocks = b * context // block_size
        k_cache = torch.randn(blocks, block_size, hk, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(b, -1)  # scattered blocks
        seqlens = torch.full((b,), context, device="cuda", dtype=torch.int32)
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)

        kk, vv = (gather(c, table).contiguous() for c in (k_cache, v_cache))
        qt = q.transpose(1, 2)
        ours = bench(partial(flash_attn_with_kvcache, q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table))
        sdpa = bench(partial(F.scaled_dot_product_attention, qt, kk, vv, enable_gqa=True))
        torch_paged = bench(partial(gather_sdpa, qt, k_cache, v_cache, table))
        err = (flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)
               - F.scaled_dot_product_attention(qt, kk, vv, enable_gqa=True).transpose(1, 2)).abs().max().item()
        gbs = 2 * b * context * hk * d * 2 / ours / 1e6
        print(f"{b:5d} | {ours:8.3f} {gbs:7.0f} | {sdpa:15.3f} | {torch_paged:13.3f} | {ours / sdpa:9.2f} {err:9.4f}")


def gemm(sizes: list[int]) -> None:
    from minillm.kernels.matmul import matmul

    print("\nmatmul, bf16, M = N = K (ms, TFLOP/s)")
    print(f"{'size':>5} | {'Triton tiled':>16} | {'cuBLAS':>16} | {'ratio':>5}")
    for n in sizes:
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ours, cublas = bench(partial(matmul, a, b)), bench(partial(torch.matmul, a, b))
        print(f"{n:5d} | {fmt(ours, 2 * n ** 3)} | {fmt(cublas, 2 * n ** 3)} | {ours / cublas:5.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes (a smoke test)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/attention.py: skipped, no CUDA GPU here. Triton's CPU interpreter checks correctness "
              "(tests/test_kernels.py), not speed; run this on a GPU.")
        return 0
    import triton

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    lengths = [1024, 4096] if args.quick else [512, 1024, 2048, 4096, 8192]
    ratios = prefill(lengths, [128] if args.quick else [64, 128])
    decode([1, 16] if args.quick else [1, 16, 64], context=4096)
    gemm([2048] if args.quick else [1024, 4096, 8192])
    for d in (64, 128):
        if (True, d, 4096) in ratios:
            r = ratios[(True, d, 4096)]
            print(f"causal prefill N=4096 d={d}: ours/SDPA = {r:.2f} "
                  f"({'within' if r <= TARGET else 'MISSES'} the {TARGET}x target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
