"""Chapter 6 — the quantized number formats themselves: a float weight rounded to int8, int4 or fp8 and read back.

Each format stores a weight `[out, in]` as small numbers plus a few float scales per row (or per group of
`group_size` inputs in a row; the kernels keep int4's scale and zero in 16 bits), so a decode step, which reads
every weight once, reads fewer bytes:

    int8   symmetric per output channel     w ~ q * scale,          q in [-127, 127]          8 bits + 32/in
           or per group of G (GGUF's Q8_0)                                                     8 bits + 32/G
    int4   asymmetric per group (GGUF Q4_1) w ~ q * scale + zero,   q in [0, 15], 2 per byte  4 bits + 32/G
    fp8    e4m3 per output channel          w ~ float(q) * scale,   |q| <= 448                8 bits + 32/in

Plain PyTorch on any device, and nothing of minillm's: the kernels, the quantized KV cache and the quantized layers
(`minillm.quant`) all build on these functions.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def check_weight(w: torch.Tensor) -> None:
    """Raise a clear error unless `w` is a 2-D floating-point weight `[out, in]`, the one shape every format takes."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"expected a 2-D floating-point weight [out, in], got {tuple(w.shape)} {w.dtype}")


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32, group_size: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8: (q int8 `[out, in]`, scale float32), w ~ q * scale, with one scale per output channel
    (`[out]`) or, given `group_size`, per group of that many inputs (`[out, in / G]`, GGUF's Q8_0 with G = 32).
    The scales are rounded to `scale_dtype` first (a kernel that takes bfloat16 scales then computes with exactly
    these). Rows are rounded a slice at a time, so a large matrix (a vocabulary's embedding) needs no float
    temporaries of its own size."""
    check_weight(w)
    out_features, in_features = w.shape
    if group_size is not None and (group_size < 1 or in_features % group_size):
        raise ValueError(f"group size {group_size} must divide the {in_features} inputs of the weight")
    per_group = group_size or in_features
    q = torch.empty(out_features, in_features, dtype=torch.int8, device=w.device)
    scale = torch.empty(out_features, in_features // per_group, dtype=torch.float32, device=w.device)
    tiny = torch.finfo(scale_dtype).tiny
    step = max(1, (1 << 22) // in_features)  # rows per slice: 16 MB of float32
    for r in range(0, out_features, step):
        groups = w[r:r + step].float().view(-1, in_features // per_group, per_group)
        s = (groups.abs().amax(dim=-1) / 127).clamp(min=tiny).to(scale_dtype).float().clamp(min=tiny)
        q[r:r + step] = torch.round(groups / s[..., None]).clamp(-127, 127).to(torch.int8).view(-1, in_features)
        scale[r:r + step] = s
    return q, scale if group_size else scale[:, 0]


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight of `quantize_int8`'s output: a scale per row (`[out]`) or per group (`[out, in / G]`)."""
    if scale.dim() == 1:
        return q.float() * scale[:, None]
    out_features, in_features = q.shape
    return (q.float().view(out_features, scale.shape[1], -1) * scale[..., None]).view(out_features, in_features)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of `group_size` inputs (GGUF's Q4_1): (q uint8 `[out, in]` in 0..15,
    scale `[out, in / G]`, zero `[out, in / G]`), w ~ q * scale + zero with zero the group's minimum."""
    check_weight(w)
    out_features, in_features = w.shape
    if group_size < 2 or in_features % group_size:
        raise ValueError(f"group size {group_size} must divide the {in_features} inputs of the weight")
    groups = w.float().view(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.view(out_features, in_features), scale, low


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    out_features, in_features = q.shape
    groups = q.float().view(out_features, scale.shape[1], -1)
    return (groups * scale[..., None] + zero[..., None]).view(out_features, in_features)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit values per byte along the last dimension: element 2i in the low nibble, 2i + 1 in the high."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even last dimension, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 per output channel: (q float8_e4m3fn `[out, in]`, scale float32 `[out]`), each row scaled
    so its largest magnitude lands on the format's largest value."""
    check_weight(w)
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]
