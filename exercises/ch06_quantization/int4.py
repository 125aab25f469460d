"""Exercise 6 — int4 weights: quantize in groups, pack two per byte, read llama.cpp's Q4_1 blocks, multiply by a
packed weight and measure what the format loses.

Replace each `raise NotImplementedError(...)` with your code, then run `make grade CH=06`.
Use plain Python, PyTorch (and numpy or `struct` if you like); do not import minillm.quant,
minillm.quant_formats, minillm.gguf_blocks or minillm.kernels.quant_matmul (that is what you are rebuilding), and
do not use the `gguf` package's decoders in `gguf.quants` (the grader compares your decoder with them).

The format: a weight `[out, in]` is cut into groups of `group_size` consecutive inputs of a row. Each group
keeps a float32 `zero` (its smallest value) and `scale` (its range over 15), and each weight becomes an
integer q in 0..15 with w ~ q * scale + zero.
"""

from __future__ import annotations

import torch


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of `group_size` inputs: (q, scale, zero).

    w is a 2-D floating-point tensor `[out, in]` (any float dtype: compute in float32). For each group g of
    row r (inputs g * group_size .. (g + 1) * group_size - 1):
      zero[r, g]  = the group's minimum,
      scale[r, g] = (the group's maximum - its minimum) / 15,
      q[r, i]     = round((w[r, i] - zero) / scale), clamped to 0..15 (ties may round either way).
    Returns q as uint8 `[out, in]`, scale and zero as float32 `[out, in / group_size]`.
    A group whose values are all equal has range 0: give it any positive scale (e.g. torch.finfo(torch.float32)
    .tiny) so nothing divides by zero; its q are all 0 and it dequantizes exactly.
    Raise ValueError when w is not 2-D or group_size does not divide its number of inputs.
    """
    raise NotImplementedError("quantize_int4: write this function")


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The float32 weight `[out, in]` that (q `[out, in]`, scale, zero `[out, in / G]`) stand for:
    w[r, i] = q[r, i] * scale[r, i // G] + zero[r, i // G], with the group size G = in / scale.shape[1].
    Compute it in float32: a product, then a sum."""
    raise NotImplementedError("dequantize_int4: write this function")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit values (0..15) per byte along the last dimension: uint8 of shape `[..., n / 2]` for q `[..., n]`.

    Byte i holds element 2i in its low nibble and element 2i + 1 in its high nibble: q = [1, 2, 3, 4] packs to
    bytes [0x21, 0x43]. Works for any number of leading dimensions. Raise ValueError when n is odd.
    """
    raise NotImplementedError("pack_int4: write this function")


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: uint8 `[..., m]` -> uint8 `[..., 2m]` in 0..15 (low nibble first)."""
    raise NotImplementedError("unpack_int4: write this function")


def decode_q4_1(raw: bytes) -> torch.Tensor:
    """The weights stored in one or more GGUF Q4_1 blocks, as a flat float32 tensor of 32 weights per block.

    A block is 20 bytes: d (float16, little-endian), m (float16), then 16 bytes in which byte j holds the
    4-bit q of weight j in its low nibble and that of weight j + 16 in its high nibble; weight k of the block
    is d * q_k + m, computed in float32 (d and m widened to float32 first). Blocks follow one another, and so
    do their weights in the result. Raise ValueError when len(raw) is not a multiple of 20.
    """
    raise NotImplementedError("decode_q4_1: write this function")


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """y = x @ W.T for an int4 weight W `[N, K]` kept packed: what a linear layer with a quantized weight computes.

    x is `[M, K]` (a batch of M tokens) in float32, bfloat16 or float16. packed is uint8 `[N, K / 2]`, pack_int4
    of the q that quantize_int4 returns; scale and zero are floating-point `[N, K / group_size]`, and
    W[n, k] = q[n, k] * scale[n, k // group_size] + zero[n, k // group_size]. group_size is a power of two.
    Returns y `[M, N]` in x's dtype, accumulated in float32: for float32 x the float32 product (to within
    rounding), for 16-bit x within 1 % of it.
    Raise ValueError when x is not 2-D with K = 2 * packed.shape[1] columns, when group_size does not divide K,
    or when scale or zero is not `[N, K / group_size]`.
    """
    raise NotImplementedError("int4_matmul: write this function")


def quantization_error(w: torch.Tensor, group_sizes: list[int]) -> dict[int, float]:
    """What int4 in groups loses, per group size: {G: ||dequantize(quantize(w, G)) - w|| / ||w|| for G in group_sizes}.

    w is a 2-D floating-point weight `[out, in]`, not all zero, converted to float32 first; quantize and dequantize
    are quantize_int4 and dequantize_int4 above; ||.|| is the Frobenius norm (the square root of the sum of the
    squares of all elements). Every G divides `in`. Returns Python floats, keyed by G in the order given.
    """
    raise NotImplementedError("quantization_error: write this function")
