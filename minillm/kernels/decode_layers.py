"""Chapter 2 — a float32 model's decode-only step through all its layers in one call (`decode_layers.cpp`).

Between a decode step's weight products on a CPU sit a few small operations per layer, each called from Python
after a product has streamed megabytes of weights through the caches and pushed out the interpreter's own data
(§2.7 measures that cold price). This C++ loop makes the calls `model.py` makes, in its order, on the same kernels:
PyTorch's products (oneDNN's on the packed weights), the C RMSNorm and SiLU times up of `small_ops.c`, and the C
attention of `cpu.py`, which rotates and stores the new keys and values as it goes. So it computes the same floats
as the modules, bit for bit; only the Python between the calls is gone. A quantized model whose products the fused C
step can run uses that instead (`decode_step.py`); `CausalLM.fused_decode` picks.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import cpu, small_ops

SOURCE = Path(__file__).with_name("decode_layers.cpp")


@functools.cache
def _operator():
    """`torch.ops.minillm.decode_layers`, built and pointed at the C functions, or None where it cannot be."""
    if cpu._library() is None or not small_ops.small_ops_available():
        return None
    library = cpu.build_torch_library(SOURCE)
    if library is None:
        return None
    torch.ops.load_library(str(library))
    address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
    torch.ops.minillm.set_kernels(address(small_ops._library().rms_norm_f32),
                                  address(small_ops._library().silu_mul_f32),
                                  address(cpu._library().rope_store_decode))
    return torch.ops.minillm.decode_layers


def decode_layers_available() -> bool:
    """Whether the loop is built (building it now if needed: a C++ compiler and PyTorch's headers) and loadable."""
    return _operator() is not None


class DecodeLayers:
    """The decode step of a float32 model's decoder `layers` (`model.DecoderLayer`s with dense MLPs and
    `layers.Linear` products, a bias on q/k/v at most) over the pools `caches`, one `kv_cache.KVCache.layer` per
    layer, with RoPE tables `cos` and `sin_signed` (`layers.RotaryEmbedding`'s). Called like
    `decode_step.FusedDecodeStep`, on the embeddings of one new token per sequence."""

    def __init__(self, layers, caches: list[tuple[torch.Tensor, ...]], cos: torch.Tensor, sin_signed: torch.Tensor,
                 eps: float):
        if _operator() is None:
            raise RuntimeError("the float32 decode loop could not be built here (a C++ compiler and PyTorch's "
                               "headers are needed)")
        if not layers or len(caches) != len(layers):
            raise ValueError(f"give one cache per layer: {len(layers)} layers, {len(caches)} caches")
        self.products = [p for layer in layers for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                         layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        self.attention = [layer.self_attn for layer in layers]
        self.norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        self.caches = [t for cache in caches for t in cache]
        self.cos, self.sin_signed, self.eps = cos, sin_signed, eps

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor) -> torch.Tensor:
        """The last layer's output for `x` `[seqs, hidden]` (float32, contiguous; left unchanged): sequence i's new
        token sits at `positions[i]` and goes into cache slot `slots[i]` (int64); `block_tables` `[seqs,
        max_blocks]` and `context_lens` `[seqs]` (int32, contiguous) give its blocks and its length with the new
        token. Unchecked, as the engine's other kernels are at every step."""
        rows, weights, packed = x.shape[0], [], []
        for p in self.products:  # read at every call, as the modules read them: pruning and repacking change them
            use = rows >= p.packed_min_rows and p.packed is not None  # as `layers.Linear.product` picks
            packed.append(int(use))
            weights.append(p.packed if use else p.weight)
        attention = self.attention
        return _operator()(x, weights, packed, [a.qkv_proj.bias for a in attention], [n.weight for n in self.norms],
                           self.caches, self.cos, self.sin_signed, positions, slots, block_tables, context_lens,
                           [a.num_heads for a in attention], self.eps, attention[0].scale)
