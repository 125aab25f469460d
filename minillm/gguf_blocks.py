"""Chapter 6 — llama.cpp's GGUF weight blocks decoded from raw bytes: what a quantized file really stores.

A Q4_1 or Q8_0 matrix is cut into blocks of 32 consecutive weights of a row, each stored as a few float16
numbers and 32 small integers:

    Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes of nibbles   w = d * q + m,  q in 0..15   (20 * 8 / 32 = 5 bits)
    Q8_0  34 bytes: fp16 d, 32 int8                       w = d * q,      q in -128..127  (8.5 bits)

In a Q4_1 block, byte j holds weight j in its low nibble and weight j + 16 in its high nibble. Q4_1 is
`minillm.quant_formats`'s int4 format with group 32 (scale = d, zero = m): `q4_1_to_int4` maps one onto the other.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from .weights import default_gguf_path

BLOCK_WEIGHTS = 32  # weights per Q4_1 or Q8_0 block
Q4_1_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_1][1]  # 20
Q8_0_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][1]  # 34

Raw = bytes | np.ndarray | torch.Tensor


def _blocks(raw: Raw, block_bytes: int, qtype: str) -> torch.Tensor:
    """Raw bytes as a uint8 tensor `[num_blocks, block_bytes]`; a clear error unless they are whole blocks."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    elif isinstance(raw, np.ndarray) and raw.dtype == np.uint8:
        data = torch.from_numpy(np.array(raw, copy=True).reshape(-1))
    elif isinstance(raw, torch.Tensor) and raw.dtype == torch.uint8:
        data = raw.detach().cpu().reshape(-1)
    else:
        what = getattr(raw, "dtype", type(raw).__name__)
        raise ValueError(f"{qtype} data must be bytes or a uint8 array or tensor, got {what}")
    if data.numel() % block_bytes:
        raise ValueError(f"{qtype} data holds {data.numel()} bytes, not a whole number of {block_bytes}-byte blocks")
    return data.view(-1, block_bytes)


def _fp16(columns: torch.Tensor) -> torch.Tensor:
    """Two little-endian bytes per row read as one float16, widened to float32: `[n, 2]` uint8 -> `[n, 1]`."""
    return columns.contiguous().view(torch.float16).float()


def _q4_1_parts(raw: Raw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 blocks split into (q uint8 `[n, 32]` in 0..15, d `[n, 1]`, m `[n, 1]`), d and m in float32."""
    blocks = _blocks(raw, Q4_1_BYTES, "Q4_1")
    nibbles = blocks[:, 4:]
    q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=1)  # weights 0..15 from low nibbles, 16..31 from high
    return q, _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])


def decode_q4_1(raw: Raw) -> torch.Tensor:
    """Q4_1 blocks -> their weights as a flat float32 tensor (32 per block, in file order)."""
    q, d, m = _q4_1_parts(raw)
    return (d * q.float() + m).reshape(-1)


def decode_q8_0(raw: Raw) -> torch.Tensor:
    """Q8_0 blocks -> their weights as a flat float32 tensor (32 per block, in file order)."""
    blocks = _blocks(raw, Q8_0_BYTES, "Q8_0")
    d, q = _fp16(blocks[:, 0:2]), blocks[:, 2:].contiguous().view(torch.int8)
    return (q.float() * d).reshape(-1)


def bits_per_weight(qtype: str) -> float:
    """Storage per weight of a GGML type, scales included: "Q4_0" 4.5, "Q4_1" 5.0, "Q8_0" 8.5, "F16" 16."""
    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype.upper()]]
    except KeyError:
        raise ValueError(f"unknown GGML type {qtype!r}; known: {', '.join(t.name for t in GGML_QUANT_SIZES)}") from None
    return type_size * 8 / block_size


def read_tensor(name: str, path: str | os.PathLike | None = None) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """One tensor of a GGUF file (default: the default model's) as (raw bytes, a flat uint8 array; its type name,
    e.g. "Q4_1"; its shape in PyTorch's order, `[out, in]`, the reverse of GGUF's). Rows are in the file's order:
    llama.cpp permutes the rows of attn_q and attn_k for its rotary embedding."""
    path = default_gguf_path() if path is None else path
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    if name not in tensors:
        raise ValueError(f"no tensor {name!r} in {path}; it holds {len(tensors)}, e.g. {', '.join(list(tensors)[:4])}")
    return tensor_parts(tensors[name])


def tensor_parts(tensor) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """`read_tensor`'s triple for one tensor of an open `GGUFReader` (for reading a whole file's tensors in turn)."""
    raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)
    return raw, tensor.tensor_type.name, tuple(int(n) for n in reversed(tensor.shape))


def q4_1_to_int4(raw: Raw, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 matrix `[out, in]` as `minillm.quant_formats`'s int4 with group 32: (q uint8 `[out, in]` in 0..15,
    scale `[out, in / 32]`, zero `[out, in / 32]`), so that `dequantize_int4(q, scale, zero)` is exactly
    `decode_q4_1(raw)` reshaped to `shape`."""
    out_features, in_features = shape
    if in_features % BLOCK_WEIGHTS:
        raise ValueError(f"a Q4_1 row holds whole blocks of {BLOCK_WEIGHTS} weights; {in_features} inputs do not")
    q, d, m = _q4_1_parts(raw)
    groups = in_features // BLOCK_WEIGHTS
    if q.shape[0] != out_features * groups:
        raise ValueError(f"a Q4_1 matrix of shape {tuple(shape)} holds {out_features * groups} blocks; "
                         f"the data holds {q.shape[0]}")
    return q.reshape(out_features, in_features), d.view(out_features, groups), m.view(out_features, groups)
