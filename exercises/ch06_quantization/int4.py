"""Exercise 6 — int4 weights: quantize in groups, pack two per byte, and read llama.cpp's Q4_1 blocks.

Replace each `raise NotImplementedError(...)` with your code, then run `make grade CH=06`.
Use plain Python, PyTorch (and numpy or `struct` if you like); do not import minillm.quant or
minillm.gguf_blocks (that is what you are rebuilding), and do not call the `gguf` package's dequantize
(the grader compares your decoder with it).

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
