"""Chapter 2 — the small building blocks of a Llama-family block: RMSNorm, rotary embeddings, SwiGLU, linear
layers.

Every linear layer of the model is a `Linear` (or one of its tensor-parallel kinds in `parallel/`), which
quantization (chapter 6) replaces in place.
"""

from __future__ import annotations

import functools
import math
import os
import statistics

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .kernels import small_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 like the reference implementation.

    For float32 rows on a CPU it is a C function (`kernels/small_ops.c`), the one the fused decode step of chapter 6
    runs: at batch 1 a norm is all per-call cost, and one C call costs less than torch's reductions (chapter 2
    measures both). Elsewhere it is torch's `F.rms_norm`.
    """
    if x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous() and runs_in_c(x, weight):
        return small_ops.rms_norm(x, weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def runs_in_c(*tensors: torch.Tensor) -> bool:
    """Whether a small operation on `tensors` runs as its C function (`kernels/small_ops.py`): float32 on a CPU,
    no gradient wanted, no dispatch mode watching, and the functions built here."""
    return (all(t.dtype == torch.float32 and t.is_cpu for t in tensors) and not torch.is_grad_enabled()
            and not dispatch_mode_active() and small_ops.small_ops_available())


class RMSNorm(nn.Module):
    """Root-mean-square layer norm: rescales each vector to unit RMS, then by a learned gain."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies theta^(-2i/d), optionally rescaled ("linear" or Llama 3's "llama3")."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"rope scaling {kind!r} is not supported; supported: default, linear, llama3")


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [max_positions, head_dim] (each frequency used for both halves)."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] by its positions' angles (half-split layout, as in HF Llama).

    cos and sin are `[tokens, head_dim]`, or already `[tokens, 1, head_dim]` to broadcast over heads.
    The result is x * cos + cat(-x2, x1) * sin, with x1, x2 the two halves of each head.
    """
    if cos.dim() == x.dim() - 1:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return rotate(x, cos, signed_sin(sin))


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated, so that `rotate` needs no negation of its own."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE in three operations: cat(-x2, x1) * sin equals x rolled by half a head times the signed sin.

    For float32 on a CPU, `[tokens, heads, head_dim]` with one cos row per token, it is a C function (see
    `rms_norm`)."""
    if x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and cos.shape == sin_signed.shape == (
            x.shape[0], 1, x.shape[2]) and cos.is_contiguous() and sin_signed.is_contiguous() \
            and runs_in_c(x, cos, sin_signed):
        return small_ops.rope(x, cos, sin_signed)
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k from precomputed cos/sin tables indexed by token position."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.theta, self.max_positions, self.scaling = head_dim, theta, max_positions, scaling
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin_signed", torch.empty(max_positions, head_dim), persistent=False)
        self.build_tables()

    def build_tables(self) -> None:
        """(Re)compute the cos/sin tables in float32 on the buffers' device (also after `to_empty`)."""
        if self.cos.is_meta:
            return
        cos, sin = rope_cos_sin(rope_inv_freq(self.head_dim, self.theta, self.scaling), self.max_positions)
        self.cos, self.sin_signed = cos.to(self.cos.device), signed_sin(sin).to(self.sin_signed.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (see `rotate`) of the given positions, `[tokens, 1, head_dim]`.

        Looked up once per step and shared by every layer.
        """
        return self.cos[positions, None].to(dtype), self.sin_signed[positions, None].to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin_signed = self.cos_sin(positions, q.dtype)
        return rotate(q, cos, sin_signed), rotate(k, cos, sin_signed)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: silu(gate) * up, with gate and up stacked in the last dimension (a C function for float32
    `[tokens, 2n]` on a CPU, see `rms_norm`)."""
    if gate_up.dim() == 2 and gate_up.is_contiguous() and runs_in_c(gate_up):
        return small_ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def use_packed_weights(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether linear layers run on oneDNN-packed weights: float32 on a CPU with oneDNN, unless
    `MINILLM_PACKED_WEIGHTS=0` (to measure what packing brings)."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and os.environ.get("MINILLM_PACKED_WEIGHTS", "1") != "0")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight [out, in]` reordered into oneDNN's blocked layout for `packed_linear` (an opaque copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` (plus `residual`, added inside the same oneDNN call) on the packed weight.

    PyTorch's float32 `F.linear` on a CPU calls MKL's GEMM, which on some processors (AMD's, for one) runs a
    generic code path; oneDNN picks its kernels for the processor it finds, and with the weight laid out in
    its blocks once, at load time, a decode step's products ran 1.4 times (batch 1) to 1.8 times (batch 64)
    as fast on the machines this book was written on (`benchmarks/decode_batch.py` measures both).
    """
    if residual is not None:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


PROBE_ROWS = (1, 4, 16, 64, 256)  # row counts at which the two product kernels are timed against each other
PLAIN_MARGIN = 0.85  # F.linear is chosen for a row count only where it takes at most this share of oneDNN's time


@functools.cache
def packed_min_rows(out_features: int, in_features: int, threads: int) -> int:
    """The fewest rows from which a float32 product of this shape runs on oneDNN's packed weight rather than through
    `F.linear` (MKL, or whatever BLAS PyTorch was built with), timed on this machine once per process and shape.

    Which is faster depends on the CPU, not on its vendor's name: on some, MKL's matrix-vector path takes half
    oneDNN's time at one row; on others it runs generic code and oneDNN wins at every row count. Both kernels are
    timed in turn at each of `PROBE_ROWS`; F.linear keeps the row counts below the largest probe where it clearly
    won (`PLAIN_MARGIN`), so that a noisy timing cannot swap kernels where they are close. 1 means always packed.
    """
    from .roofline import time_interleaved

    weight = torch.randn(out_features, in_features) * 0.02
    packed = pack_weight(weight)
    threshold = 1
    with torch.inference_mode():
        for rows in PROBE_ROWS:
            x = torch.randn(rows, in_features)
            plain, onednn = time_interleaved([lambda: F.linear(x, weight), lambda: packed_linear(x, packed)],
                                             repeats=9, warmup=2)
            if statistics.median(plain) <= PLAIN_MARGIN * statistics.median(onednn):
                threshold = rows + 1
    return threshold


def dispatch_mode_active() -> bool:
    """Whether a PyTorch dispatch mode (FlopCounterMode, fake tensors) is watching: the paths that bypass the
    dispatcher or use opaque weights (oneDNN-packed layers, the C attention kernel) step aside for it."""
    return _get_current_dispatch_mode() is not None


def runs_packed(packed: torch.Tensor | None) -> bool:
    """Whether a product should use its oneDNN-packed weight: there is one, no gradient is wanted, and no
    dispatch mode is watching (those get the plain weight through `F.linear`)."""
    return packed is not None and not torch.is_grad_enabled() and not dispatch_mode_active()


class Linear(nn.Linear):
    """`nn.Linear` that runs on a oneDNN-packed copy of its weight once `pack()` has made one.

    The plain `weight` stays what every reader of the model sees (and what dispatch modes, and autograd, get).
    """

    packed: torch.Tensor | None = None
    packed_min_rows: int = 1  # products of fewer rows run through F.linear (see `packed_min_rows`)

    def pack(self, min_rows: int | None = None) -> None:
        """Make (or, after the weight changed, remake) the packed copy, used for products of at least `min_rows`
        rows (None keeps the count chosen before)."""
        self.packed = pack_weight(self.weight)
        if min_rows is not None:
            self.packed_min_rows = min_rows

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`x W^T + b`, plus `residual` when given (the block's skip connection, fused into the product)."""
        return self.product(x, self.bias, residual)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor:
        """`x W^T`, plus `bias` and `residual` when given, on the packed weight where there is one."""
        if x.dim() == 2 and x.shape[0] >= self.packed_min_rows and runs_packed(self.packed):
            return packed_linear(x, self.packed, bias, residual)
        y = F.linear(x, self.weight, bias)
        return y if residual is None else y + residual
