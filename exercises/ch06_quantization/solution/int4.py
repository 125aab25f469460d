"""A solution to exercise 6 written from the stub's signatures and docstrings alone, never from minillm.

`python -m exercises.selfcheck` grades it: full marks prove that the stub says everything the grader checks.
It lives in its own folder so that the stub finder sees one student file.
"""

from __future__ import annotations

import struct

import torch


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of `group_size` inputs: (q uint8 `[out, in]`, scale, zero float32 `[out, in / G]`)."""
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [out, in], got shape {tuple(w.shape)}")
    rows, cols = w.shape
    if group_size < 1 or cols % group_size:
        raise ValueError(f"group_size {group_size} does not divide the {cols} inputs")
    groups = w.float().reshape(rows, cols // group_size, group_size)
    zero = groups.min(dim=2).values
    scale = (groups.max(dim=2).values - zero) / 15
    scale = torch.where(scale > 0, scale, torch.full_like(scale, torch.finfo(torch.float32).tiny))
    q = ((groups - zero.unsqueeze(2)) / scale.unsqueeze(2)).round().clamp(0, 15)
    return q.to(torch.uint8).reshape(rows, cols), scale, zero


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """w[r, i] = q[r, i] * scale[r, i // G] + zero[r, i // G] in float32."""
    group = q.shape[1] // scale.shape[1]
    return q.float() * scale.repeat_interleave(group, dim=1) + zero.repeat_interleave(group, dim=1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Element 2i in the low nibble of byte i, element 2i + 1 in its high nibble."""
    if q.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even to pack two per byte, got {q.shape[-1]}")
    pairs = q.to(torch.uint8).reshape(*q.shape[:-1], q.shape[-1] // 2, 2)
    return pairs[..., 0] + pairs[..., 1] * 16


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., m]` -> uint8 `[..., 2m]`, low nibble first."""
    low, high = packed % 16, packed // 16
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def decode_q4_1(raw: bytes) -> torch.Tensor:
    """Flat float32 weights of one or more 20-byte Q4_1 blocks: d * q + m per weight."""
    if len(raw) % 20:
        raise ValueError(f"{len(raw)} bytes is not a whole number of 20-byte Q4_1 blocks")
    weights = []
    for start in range(0, len(raw), 20):
        d, m = struct.unpack_from("<ee", raw, start)
        nibbles = raw[start + 4:start + 20]
        q = [b & 0x0F for b in nibbles] + [b >> 4 for b in nibbles]
        weights.append(torch.tensor(d, dtype=torch.float32) * torch.tensor(q, dtype=torch.float32)
                       + torch.tensor(m, dtype=torch.float32))
    return torch.cat(weights) if weights else torch.zeros(0)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """x `[M, K]` @ W.T for W unpacked from `packed` and dequantized, in float32, returned in x's dtype."""
    n, k = packed.shape[0], 2 * packed.shape[-1]
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}] to match packed {tuple(packed.shape)}, got {tuple(x.shape)}")
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide K = {k}")
    for name, t in (("scale", scale), ("zero", zero)):
        if tuple(t.shape) != (n, k // group_size):
            raise ValueError(f"{name} must be {(n, k // group_size)}, got {tuple(t.shape)}")
    w = dequantize_int4(unpack_int4(packed), scale.float(), zero.float())
    return (x.float() @ w.T).to(x.dtype)


def quantization_error(w: torch.Tensor, group_sizes: list[int]) -> dict[int, float]:
    """{G: ||dequantize(quantize(w, G)) - w|| / ||w||}, Frobenius norms in float32."""
    w = w.float()
    return {g: float(torch.linalg.norm(dequantize_int4(*quantize_int4(w, g)) - w) / torch.linalg.norm(w))
            for g in group_sizes}
