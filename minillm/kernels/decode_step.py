"""Chapter 6 — a quantized model's decode step in one C call (`decode_step.c`): every layer's norm, products, RoPE,
cache store, attention and SwiGLU for a batch of sequences that each decode one token, and where the model's
embedding and head are int8, the embedding lookup before them and the final norm and head after: token ids in,
logits out.

At batch 1 on a CPU the int4 products take about half of a decode step; the rest is a few hundred small PyTorch
operations and the Python between them, each paying its dispatch and its trip through cold caches. Fusing them
leaves a step that is its products plus the few microseconds of arithmetic between them. The layers' weights must
be in the C product kernel's layouts (`int4_cpu.Int4Weight`, `Int8Weight`) and the cache a float32 pool or an
int8 one with a scale per vector (a quarter of the bytes for attention to read); the model decides when that
holds (`minillm.model.CausalLM.fused_decode`), and the unfused modules stay the reference.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .cpu import build_and_load
from .int4_cpu import Int4Weight, Int8Weight, _weight_args, adopt

SOURCE = Path(__file__).with_name("decode_step.c")


class _Weight(ctypes.Structure):
    _fields_ = [("bits", ctypes.c_int), ("q", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("zero", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("g", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight), ("down", _Weight),
                ("qkv_bias", ctypes.c_void_p), ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int64), ("hidden", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64), ("block_size", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("layers", ctypes.POINTER(_Layer)),
                ("cos", ctypes.c_void_p), ("sin_signed", ctypes.c_void_p),
                ("embed_q", ctypes.c_void_p), ("embed_scale", ctypes.c_void_p), ("final_norm", ctypes.c_void_p),
                ("head", _Weight)]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The step built for this machine, or None where it cannot be built."""
    lib = build_and_load(SOURCE)
    if lib is None:
        return None
    adopt(lib)  # the products' AMX switch, set as the kernel's
    lib.decode_step_f32.restype = None
    lib.decode_step_f32.argtypes = [ctypes.POINTER(_Model), ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 5 \
        + [ctypes.c_int64, ctypes.c_void_p]
    return lib


def decode_step_available() -> bool:
    """Whether the fused step is built (building it now if needed) and loadable here."""
    return _library() is not None


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer as the fused step reads it: its four products in the C kernel's layouts, its two
    RMSNorm gains (float32 `[hidden]`) and the q/k/v product's bias (float32 `[q + 2 kv]`; None where the family has
    none). The bias is added after the product, as `QuantLinear.forward` adds it."""
    qkv: Int4Weight | Int8Weight
    o: Int4Weight | Int8Weight
    gate_up: Int4Weight | Int8Weight
    down: Int4Weight | Int8Weight
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_bias: torch.Tensor | None = None


@dataclass(frozen=True)
class StepEnds:
    """What a step needs to go from token ids to logits in the same call: the token embedding as `QuantEmbedding`
    keeps it in int8 (codes `[vocab, hidden]`, a float32 scale per row), the final RMSNorm's gain (float32
    `[hidden]`) and the head's product in the C kernel's layout (no bias)."""
    embed_q: torch.Tensor
    embed_scale: torch.Tensor
    final_norm: torch.Tensor
    head: Int4Weight | Int8Weight


def _weight(w: Int4Weight | Int8Weight) -> _Weight:
    """The product kernel's leading arguments for `w` (bits, pointers, sizes, group), as the step's struct."""
    return _Weight(*_weight_args(w))


class FusedDecodeStep:
    """The decode step of a model whose layers are `layers`, over the pools `caches`, one per layer: `(k, v)`,
    float32 `[blocks, block_size, kv_heads, head_dim]` each, or `(k, v, k_scale, v_scale)`, int8 pools with float32
    scales `[blocks, block_size, kv_heads]` (`kv_cache.KVCache.layer`'s); with RoPE tables `cos` and `sin_signed`
    `[positions, head_dim]` (`layers.RotaryEmbedding`'s). Call it on the embeddings of one new token per sequence;
    given the model's `ends`, `logits` takes the tokens themselves and returns their scores."""

    def __init__(self, layers: list[LayerWeights], caches: list[tuple[torch.Tensor, ...]], cos: torch.Tensor,
                 sin_signed: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int,
                 ends: StepEnds | None = None):
        if _library() is None:
            raise RuntimeError("the fused decode step could not be built here (is a C compiler installed?)")
        if not layers or len(caches) != len(layers):
            raise ValueError(f"give one cache per layer: {len(layers)} layers, {len(caches)} caches")
        blocks, block_size, kv_heads, head_dim = caches[0][0].shape
        pool = caches[0][0].dtype  # float32, or int8 with scales
        hidden = layers[0].qkv.in_features
        q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
        inter = layers[0].down.in_features
        for i, (layer, cache) in enumerate(zip(layers, caches)):
            shapes = {"qkv": (layer.qkv, q_width + 2 * kv_width, hidden), "o": (layer.o, hidden, q_width),
                      "gate_up": (layer.gate_up, 2 * inter, hidden), "down": (layer.down, hidden, inter)}
            for name, (w, n, k_in) in shapes.items():
                first = getattr(layers[0], name)
                if (w.out_features, w.in_features, w.group_size) != (n, k_in, first.group_size):
                    raise ValueError(f"layer {i}'s {name} is {w.out_features}x{w.in_features} in groups of "
                                     f"{w.group_size}; expected {n}x{k_in} in groups of {first.group_size}")
            if pool not in (torch.float32, torch.int8) or len(cache) != (2 if pool == torch.float32 else 4):
                raise ValueError(f"layer {i}'s cache must be float32 (k, v) or int8 (k, v, k_scale, v_scale) pools, "
                                 f"got {len(cache)} tensors of {pool}")
            pools = (blocks, block_size, num_kv_heads, head_dim)
            wanted = ((pool, pools), (pool, pools), (torch.float32, pools[:3]), (torch.float32, pools[:3]))
            for name, t, (dtype, shape) in zip(("k cache", "v cache", "k scales", "v scales"), cache, wanted):
                if t.dtype != dtype or not t.is_contiguous() or t.shape != shape:
                    raise ValueError(f"layer {i}'s {name} must be contiguous {dtype} shaped {shape}, "
                                     f"got {tuple(t.shape)} {t.dtype}")
            for name, t in (("input_norm", layer.input_norm), ("post_norm", layer.post_norm)):
                if t.dtype != torch.float32 or not t.is_contiguous() or t.shape != (hidden,):
                    raise ValueError(f"layer {i}'s {name} gain must be a contiguous float32 [{hidden}]")
            bias = layer.qkv_bias
            if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()
                                     or bias.shape != (q_width + 2 * kv_width,)):
                raise ValueError(f"layer {i}'s qkv_bias must be a contiguous float32 [{q_width + 2 * kv_width}]")
        if kv_heads != num_kv_heads or num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads over {kv_heads} cached KV heads (given {num_kv_heads})")
        for name, t in (("cos", cos), ("sin_signed", sin_signed)):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.dim() != 2 or t.shape[1] != head_dim:
                raise ValueError(f"{name} must be a contiguous float32 table [positions, {head_dim}]")
        if ends is not None:
            vocab = ends.embed_q.shape[0]
            wanted = {"embed_q": (ends.embed_q, torch.int8, (vocab, hidden)),
                      "embed_scale": (ends.embed_scale, torch.float32, (vocab,)),
                      "final_norm": (ends.final_norm, torch.float32, (hidden,))}
            for name, (t, dtype, shape) in wanted.items():
                if t.dtype != dtype or not t.is_contiguous() or t.shape != shape:
                    raise ValueError(f"ends.{name} must be contiguous {dtype} shaped {shape}, "
                                     f"got {tuple(t.shape)} {t.dtype}")
            if ends.head.in_features != hidden:
                raise ValueError(f"the head takes {ends.head.in_features} inputs; the layers give {hidden}")
        self.ends = ends
        self._keep = (layers, caches, cos, sin_signed, ends)  # the tensors behind the pointers below
        self._layers = (_Layer * len(layers))(*[
            _Layer(_weight(w.qkv), _weight(w.o), _weight(w.gate_up), _weight(w.down),
                   None if w.qkv_bias is None else w.qkv_bias.data_ptr(), w.input_norm.data_ptr(),
                   w.post_norm.data_ptr(), *(t.data_ptr() for t in cache), *(None,) * (4 - len(cache)))
            for w, cache in zip(layers, caches)])
        self._model = _Model(len(layers), hidden, num_heads, num_kv_heads, head_dim, block_size, eps,
                             head_dim ** -0.5, self._layers, cos.data_ptr(), sin_signed.data_ptr(),
                             *((None,) * 3 + (_Weight(),) if ends is None else (
                                 ends.embed_q.data_ptr(), ends.embed_scale.data_ptr(), ends.final_norm.data_ptr(),
                                 _weight(ends.head))))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor) -> torch.Tensor:
        """Run every layer over `x` `[seqs, hidden]` (float32, contiguous), in place, and return it: sequence i's new
        token sits at `positions[i]` and goes into cache slot `slots[i]` (int64 `[seqs]`); `block_tables` `[seqs,
        max_blocks]` and `context_lens` `[seqs]` (int32, contiguous) give its blocks and its length with the new
        token. Unchecked, as the engine's other kernels are at every step: the caller guarantees the shapes."""
        _library().decode_step_f32(ctypes.byref(self._model), x.data_ptr(), x.shape[0], None, positions.data_ptr(),
                                   slots.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
                                   block_tables.shape[1], None)
        return x

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor) -> torch.Tensor:
        """The whole step of a model with `ends`: the new tokens (int64 `[seqs]`, each below the vocabulary size)
        embedded, through every layer, the final norm and the head: their scores, float32 `[seqs, head rows]`. The
        other arguments as `__call__`'s, unchecked alike."""
        if self.ends is None:
            raise RuntimeError("this step was built without the model's ends (embedding, final norm, head)")
        m = tokens.shape[0]
        x = torch.empty(m, self._model.hidden)
        out = torch.empty(m, self.ends.head.out_features)
        _library().decode_step_f32(ctypes.byref(self._model), x.data_ptr(), m, tokens.data_ptr(),
                                   positions.data_ptr(), slots.data_ptr(), block_tables.data_ptr(),
                                   context_lens.data_ptr(), block_tables.shape[1], out.data_ptr())
        return out
