"""Chapter 6 — RMSNorm, RoPE and SiLU times up in C (`small_ops.c`), the code the fused decode step runs, called
on a CPU by `minillm.layers` for float32 tensors; and greedy sampling's argmax, called by `minillm.sampling`.

A step layer by layer and the fused step then compute the same floats, so a quantized model's greedy tokens do
not depend on which of the two ran (chapter 6.7). PyTorch's versions (in `layers.py`) stay the definitions, used
on a GPU, for other types, for autograd, and where no C compiler is found; the tests check both agree.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .cpu import build_and_load

SOURCE = Path(__file__).with_name("small_ops.c")


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The operations built for this machine, or None where they cannot be built."""
    lib = build_and_load(SOURCE)
    if lib is None:
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rms_norm_f32.argtypes = [ptr, i64, ptr, ctypes.c_float, i64, i64, ptr]
    lib.rope_f32.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ptr]
    lib.silu_mul_f32.argtypes = [ptr, i64, i64, ptr]
    lib.argmax_f32.argtypes = [ptr, i64, i64, ptr]
    lib.rms_norm_f32.restype = lib.rope_f32.restype = lib.silu_mul_f32.restype = lib.argmax_f32.restype = None
    return lib


def small_ops_available() -> bool:
    """Whether the operations are built (building them now if needed) and loadable here."""
    return _library() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`layers.rms_norm` of float32 rows `x` `[tokens, hidden]` (each row contiguous) with gain `weight`."""
    out = torch.empty(x.shape)
    _library().rms_norm_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), eps, x.shape[0], x.shape[1],
                            out.data_ptr())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`layers.rotate` of float32 `x` `[tokens, heads, head_dim]` (each token's heads contiguous) by `cos` and
    `sin_signed` `[tokens, 1, head_dim]` (contiguous), into a new tensor."""
    tokens, heads, d = x.shape
    out = torch.empty(x.shape)
    _library().rope_f32(x.data_ptr(), x.stride(0), cos.data_ptr(), sin_signed.data_ptr(), tokens, heads, d,
                        out.data_ptr())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`layers.silu_and_mul` of a contiguous float32 `[tokens, 2 * n]` `gate_up`."""
    tokens, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, n)
    _library().silu_mul_f32(gate_up.data_ptr(), tokens, n, out.data_ptr())
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its first largest value, -1 where that value is not finite (as `sampling.sample` reads
    `max(dim=-1)`), for contiguous float32 `logits` `[rows, vocab]`. PyTorch's max with indices runs a scalar loop
    here: several times slower at a decode step's batch of logits."""
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _library().argmax_f32(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
    return out
