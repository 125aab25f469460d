"""Chapter 5 — minillm's Triton kernels: FlashAttention (dense, packed varlen, paged KV cache), a tiled matmul
(`.matmul`) and products with int8/int4 weights dequantized inside the kernel (`int8_matmul`, `int4_matmul`).

The attention functions have the `flash_attn` package's signatures; `reference` holds plain PyTorch versions
with the same signatures, and `use_triton(device)` is the one place that decides which path runs (on a CPU,
`use_cpu_kernel` chooses the C decode kernel of `.cpu` over PyTorch's gather-then-SDPA). Importing
this package never imports triton (a Linux-only dependency): the kernel modules load on first use.
"""

from __future__ import annotations

from importlib import import_module

from . import reference
from .backend import interpreting, triton_available, use_cpu_kernel, use_triton
from .online_softmax import combine_partials, merge_partials, partial_attention, tiled_attention

_LAZY = {"flash_attn_func": ".api", "flash_attn_varlen_func": ".api", "flash_attn_with_kvcache": ".api",
         "int8_matmul": ".quant_matmul", "int4_matmul": ".quant_matmul"}  # module of each, loaded on first use

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "int8_matmul", "int4_matmul",
           "reference", "use_triton", "use_cpu_kernel", "triton_available", "interpreting", "partial_attention",
           "merge_partials", "combine_partials", "tiled_attention"]


def __getattr__(name: str):
    if name in _LAZY:
        if not triton_available():
            raise ImportError(f"minillm.kernels.{name} needs the triton package (pip install triton); "
                              "minillm.kernels.reference has the plain PyTorch version")
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
