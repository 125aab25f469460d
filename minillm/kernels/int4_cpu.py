"""Chapter 6 — int4 and int8 weights multiplied on a CPU in C (`int4_matmul.c`), the activations rounded to int8
per block of 32: integer dot products at memory speed.

PyTorch's `_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm` take bfloat16 activations and, at batch 1, read
their weights far below the memory's speed. llama.cpp's way is faster: quantize each row of x to int8 per block
of 32 and multiply the weight's codes with it in integers (AVX512-VNNI's `vpdpbusd`, AVX2's `vpmaddubsw`),
scaling once per block. This module lays weights of `minillm.quant_formats.quantize_int4` and `quantize_int8`
out for that kernel, built like `minillm.kernels.cpu`'s. Batches of 16 rows and more take AMX tiles where the CPU
has them (`int4_cpu_amx`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .cpu import build_and_load

SOURCE = Path(__file__).with_name("int4_matmul.c")
ROWS = 16  # weight rows per tile of the kernel's layout
BLOCK = 32  # inputs per int8 block of the activations; group sizes are multiples of it


@dataclass(frozen=True)
class Int4Weight:
    """A `[out_features, in_features]` int4 weight in the kernel's layout (see `int4_matmul.c`): `q` uint8
    `[tiles, in / 8, 16, 4]` (two codes a byte, 16 rows interleaved), `scale` and `zero` float16 `[tiles, in / G,
    16]`, the output rows padded to a multiple of 16."""
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes the packed weight occupies: 1/2 byte per weight plus 4 bytes per group of each padded row."""
        return self.q.nbytes + self.scale.nbytes + self.zero.nbytes


@dataclass(frozen=True)
class Int8Weight:
    """A `[out_features, in_features]` int8 weight in the kernel's layout (see `int4_matmul.c`): `q` int8
    `[tiles, in / 4, 16, 4]` (16 rows interleaved) and `scale` float32 `[tiles, in / G, 16]`, one scale per group
    of `group_size` inputs of each row (`group_size == in_features`: one per row), the output rows padded to a
    multiple of 16."""
    q: torch.Tensor
    scale: torch.Tensor
    group_size: int
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes the packed weight occupies: 1 byte per weight plus 4 bytes per group of each padded row."""
        return self.q.nbytes + self.scale.nbytes


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib`, the compiled kernel, with its functions' signatures declared."""
    lib.quant_matmul_f32.restype = None
    lib.quant_matmul_f32.argtypes = ([ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
                                     + [ctypes.c_void_p] * 3 + [ctypes.c_int64])
    lib.quant_matmul_isa.restype = ctypes.c_char_p
    lib.quant_matmul_isa.argtypes = []
    return adopt(lib)


_amx = {"want": True, "libraries": []}  # the AMX setting, and every loaded library built from SOURCE (see adopt)


def adopt(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib`, a library compiled from SOURCE (this kernel's, or the fused step's, which includes it), with its AMX
    switch declared and set as `int4_cpu_amx` last set it."""
    lib.quant_matmul_use_amx.restype = ctypes.c_int
    lib.quant_matmul_use_amx.argtypes = [ctypes.c_int]
    lib.quant_matmul_use_amx(int(_amx["want"]))
    _amx["libraries"].append(lib)
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The library built for this machine, or None when it cannot be built here (no compiler, not Linux/glibc)."""
    lib = build_and_load(SOURCE)
    return None if lib is None else _declare(lib)


def int4_cpu_available() -> bool:
    """Whether the C int4 and int8 kernel is built (building it now if needed) and loadable on this machine."""
    return _library() is not None


def _require() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError("the C int4/int8 kernel could not be built here (is a C compiler installed?)")
    return lib


def int4_cpu_isa() -> str:
    """The instructions the kernel was compiled for on this machine: "avx512vnni", "avx2" or "scalar"."""
    return _require().quant_matmul_isa().decode()


def int4_cpu_amx(want: bool | None = None) -> bool:
    """Whether the products take each whole group of 16 rows of x (a batch of 16 or more: batched decode, prefill) to
    AMX, the tile unit of Intel's Xeons since Sapphire Rapids, which multiplies a block of 16 rows by 16 weight rows
    in one instruction where AVX512-VNNI's `vpdpbusd` does one row: the same integer sums, so the same results to
    the bit. On where the CPU, the build (`-march=native`) and Linux allow it; `want` turns it on or off for the
    process (to measure what it brings)."""
    lib = _require()
    if want is not None:
        _amx["want"] = want
        for loaded in _amx["libraries"]:
            loaded.quant_matmul_use_amx(int(want))
    return bool(lib.quant_matmul_use_amx(-1))


def _tiles(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`[N, C, ...]` padded with zeros to a multiple of 16 rows and reordered to `[N / 16, C, 16, ...]`."""
    t = torch.cat((t, t.new_zeros(rows - t.shape[0], *t.shape[1:]))) if rows > t.shape[0] else t
    return t.view(rows // ROWS, ROWS, *t.shape[1:]).transpose(1, 2).contiguous()


def pack_int4_cpu(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> Int4Weight:
    """The kernel's layout of `quantize_int4`'s output (q uint8 `[N, K]` in 0..15, scale and zero `[N, K / G]`),
    w = q * scale + zero. `group_size` a multiple of 32 that divides K; scales and zeros are kept in float16."""
    if q.dim() != 2 or q.dtype != torch.uint8 or q.device.type != "cpu":
        raise ValueError(f"q must be a 2-D uint8 CPU tensor, got {tuple(q.shape)} {q.dtype} on {q.device}")
    n, k = q.shape
    if group_size <= 0 or group_size % BLOCK or k % group_size:
        raise ValueError(f"group size {group_size} must be a multiple of {BLOCK} dividing the {k} inputs")
    for name, t in (("scale", scale), ("zero", zero)):
        if t.shape != (n, k // group_size) or not t.is_floating_point() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a floating-point CPU tensor of shape {(n, k // group_size)}, "
                             f"got {tuple(t.shape)} {t.dtype} on {t.device}")
    if q.numel() and int(q.max()) > 15:
        raise ValueError(f"int4 codes must lie in 0..15, found {int(q.max())}")
    halves = scale.to(torch.float16), zero.to(torch.float16)
    if not all(bool(h.isfinite().all()) for h in halves):
        raise ValueError("scales and zero points must be finite in float16 (|value| <= 65504)")
    rows = -(-n // ROWS) * ROWS
    codes = _tiles(q.reshape(n, k // 8, 2, 4), rows)  # [tiles, K / 8, 16, 2, 4]: codes 8c + 4h + i
    packed = codes[..., 0, :] | (codes[..., 1, :] << 4)
    return Int4Weight(packed.contiguous(), _tiles(halves[0], rows), _tiles(halves[1], rows), group_size, n, k)


def pack_int8_cpu(q: torch.Tensor, scale: torch.Tensor) -> Int8Weight:
    """The kernel's layout of `quantize_int8`'s output (q int8 `[N, K]`, scale `[N]` for one per row or `[N, K / G]`
    for groups of G inputs), w = q * scale, for K and G multiples of 32. Any int8 code works (-128 too); the scales
    are kept in float32."""
    if q.dim() != 2 or q.dtype != torch.int8 or q.device.type != "cpu":
        raise ValueError(f"q must be a 2-D int8 CPU tensor, got {tuple(q.shape)} {q.dtype} on {q.device}")
    n, k = q.shape
    if k == 0 or k % BLOCK:
        raise ValueError(f"the {k} inputs of an int8 weight must be a positive multiple of {BLOCK}")
    groups = 1 if scale.dim() == 1 else scale.shape[-1]
    if (scale.shape[0] != n or scale.dim() not in (1, 2) or not scale.is_floating_point() or scale.device.type != "cpu"
            or groups == 0 or k % groups or (k // groups) % BLOCK):
        raise ValueError(f"scale must be a floating-point CPU tensor of shape {(n,)} or {(n, 'K / G')} with G a "
                         f"multiple of {BLOCK} dividing {k}, got {tuple(scale.shape)} {scale.dtype} on {scale.device}")
    rows = -(-n // ROWS) * ROWS
    codes = _tiles(q.reshape(n, k // 4, 4), rows)  # [tiles, K / 4, 16, 4]: inputs 4c .. 4c + 3 of 16 rows
    scales = _tiles(scale.float().reshape(n, groups), rows)  # [tiles, K / G, 16]
    return Int8Weight(codes, scales, k // groups, n, k)


def _check_output(name: str, t: torch.Tensor, rows: int, cols: int) -> None:
    if t.dtype != torch.float32 or not t.is_cpu or t.shape != (rows, cols) or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous float32 CPU tensor of shape {(rows, cols)}, "
                         f"got {tuple(t.shape)} {t.dtype} on {t.device}")


def _check_call(x: torch.Tensor, in_features: int, out_features: int, residual: torch.Tensor | None,
                out: torch.Tensor | None) -> torch.Tensor:
    """Validate the arguments of a product (see `int4_matmul_cpu`); `out`, or a new output tensor."""
    _require()
    if x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be a float32 CPU tensor [M, {in_features}], got {tuple(x.shape)} {x.dtype} "
                         f"on {x.device}")
    m = x.shape[0]
    if residual is not None:
        _check_output("residual", residual, m, out_features)
    if out is None:
        return torch.empty(m, out_features)
    _check_output("out", out, m, out_features)
    return out


def int4_matmul_cpu(x: torch.Tensor, w: Int4Weight, residual: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W^T (+ residual)` for x float32 `[M, K]` on a CPU, into `out` (float32 `[M, N]`, contiguous; may be
    `residual` itself) or a new tensor. x is rounded to int8 per block of 32 inside: the result differs from
    float32 activations by about 0.5 % of the output's scale (see `tests/test_int4_cpu.py`)."""
    out = _check_call(x, w.in_features, w.out_features, residual, out)
    return matmul_unchecked(x.contiguous(), w, residual, out)


def int8_matmul_cpu(x: torch.Tensor, w: Int8Weight, residual: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W^T (+ residual)` for an int8 weight, as `int4_matmul_cpu`: x float32 `[M, K]` rounded to int8 per
    block of 32 inside (about 0.5 % of the output's scale), `out` float32 `[M, N]` (may be `residual`) or new."""
    out = _check_call(x, w.in_features, w.out_features, residual, out)
    return matmul_unchecked(x.contiguous(), w, residual, out)


def _weight_args(w: Int4Weight | Int8Weight) -> tuple:
    """The kernel's leading arguments for weight `w`: bits, data pointers, out/in features, group size."""
    if isinstance(w, Int8Weight):
        return 8, w.q.data_ptr(), w.scale.data_ptr(), None, w.out_features, w.in_features, w.group_size
    return 4, w.q.data_ptr(), w.scale.data_ptr(), w.zero.data_ptr(), w.out_features, w.in_features, w.group_size


def bind(w: Int4Weight | Int8Weight) -> Callable[[int, int | None, int, int], None]:
    """The kernel with `w`'s arguments filled in once: `call(x_ptr, residual_ptr or None, out_ptr, m)` computes
    what `matmul_unchecked` does, on data pointers, for a layer that calls it every step (about 3 microseconds
    less per call than `matmul_unchecked`; the same guarantees are the caller's)."""
    return functools.partial(_require().quant_matmul_f32, *_weight_args(w))


def matmul_unchecked(x: torch.Tensor, w: Int4Weight | Int8Weight, residual: torch.Tensor | None,
                     out: torch.Tensor) -> torch.Tensor:
    """`out = x @ W^T (+ residual)` with no checks, for a decode loop where a microsecond a call adds up: the
    caller guarantees the kernel builds here, x float32 contiguous `[M, K]` on the CPU, and `out` (and
    `residual`, which may be `out`) float32 contiguous `[M, N]`. Wrong arguments read or write out of bounds."""
    _library().quant_matmul_f32(*_weight_args(w), x.data_ptr(), None if residual is None else residual.data_ptr(),
                                out.data_ptr(), x.shape[0])
    return out
