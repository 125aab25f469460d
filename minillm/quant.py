"""Chapter 6 — quantized weights: int8 per output channel, int4 in groups with zero points, fp8 e4m3 (what a kernel
does with the activations is its own choice: see `QuantLinear.forward`).

Each format stores a weight `[out, in]` as small numbers plus a few float scales per row (or per group of
`group_size` inputs in a row; the kernels keep int4's scale and zero in 16 bits), so a decode step, which reads
every weight once, reads fewer bytes:

    int8   symmetric per output channel     w ~ q * scale,          q in [-127, 127]          8 bits + 32/in
    int4   asymmetric per group (GGUF Q4_1) w ~ q * scale + zero,   q in [0, 15], 2 per byte  4 bits + 32/G
    fp8    e4m3 per output channel          w ~ float(q) * scale,   |q| <= 448                8 bits + 32/in

On a CPU the products run through minillm's C kernel (`kernels/int4_matmul.c`), or else PyTorch's packed kernels
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`, whose int4 layout stores `(q - 8) * scale + zero'`, i.e.
zero' = zero + 8 * scale); on a GPU through minillm's Triton kernels (`kernels/quant_matmul.py`).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from .kernels.int4_cpu import (Int4Weight, Int8Weight, bind, int4_cpu_available, int4_cpu_isa, matmul_unchecked,
                               pack_int4_cpu, pack_int8_cpu)

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what PyTorch's packed int4 CPU kernel accepts
FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def _check_weight(w: torch.Tensor) -> None:
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"expected a 2-D floating-point weight [out, in], got {tuple(w.shape)} {w.dtype}")


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q int8 `[out, in]`, scale float32 `[out]`), w ~ q * scale. The scales
    are rounded to `scale_dtype` first (a kernel that takes bfloat16 scales then computes with exactly these)."""
    _check_weight(w)
    w = w.float()
    tiny = torch.finfo(scale_dtype).tiny
    scale = (w.abs().amax(dim=1) / 127).clamp(min=tiny).to(scale_dtype).float().clamp(min=tiny)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of `group_size` inputs (GGUF's Q4_1): (q uint8 `[out, in]` in 0..15,
    scale `[out, in / G]`, zero `[out, in / G]`), w ~ q * scale + zero with zero the group's minimum."""
    _check_weight(w)
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
    _check_weight(w)
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def fake_quantize(w: torch.Tensor, method: str, group_size: int = 64) -> torch.Tensor:
    """w rounded to `method`'s grid and back (float32): what a quantized layer computes with, for measuring a
    format's error without its kernel. int4 takes any group size; a last group shorter than the others (128 does
    not divide 576) is filled out with copies of its last column, which leave its minimum and maximum alone."""
    if method == "int8":
        return dequantize_int8(*quantize_int8(w))
    if method == "fp8":
        return dequantize_fp8(*quantize_fp8(w))
    if method != "int4":
        raise ValueError(f"quantization {method!r} is not supported; use one of {QUANTIZATIONS}")
    _check_weight(w)
    pad = -w.shape[1] % group_size
    padded = F.pad(w.float()[None], (0, pad), mode="replicate")[0] if pad else w
    return dequantize_int4(*quantize_int4(padded, group_size))[:, :w.shape[1]]


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ dequantize_int8(q, scale).T through PyTorch's packed int8 kernel (activations in x's dtype)."""
    return torch.ops.aten._weight_int8pack_mm(x, q, scale.to(x.dtype))


def to_int4pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CPU layout of an int4 weight: (packed `[out, in / 2]` uint8, scales_and_zeros `[in / G, out, 2]`)."""
    if q.shape[0] % 16:
        raise ValueError(f"the int4 kernel needs a multiple of 16 output rows, got {q.shape[0]}")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    scales_and_zeros = torch.stack((scale, zero + 8 * scale), dim=-1).transpose(0, 1).contiguous()
    return packed, scales_and_zeros


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """x @ dequantize_int4(...).T through PyTorch's packed int4 CPU kernel (activations in x's dtype)."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group size {group_size} is not one the int4 kernel takes: {INT4_GROUP_SIZES}")
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros.to(x.dtype))


QUANTIZATIONS = ("int8", "int4", "fp8")


def use_c_kernel() -> bool:
    """Whether int8 and int4 products on a CPU go through minillm's C kernel (`kernels/int4_matmul.c`: integer dot
    products of the weight codes with int8-rounded activations, as llama.cpp computes): when it builds with a vector
    path for this CPU (its plain-C fallback is slower than PyTorch's kernels), unless `MINILLM_QUANT_KERNEL=torch`."""
    if os.environ.get("MINILLM_QUANT_KERNEL", "auto") == "torch":
        return False
    return int4_cpu_available() and int4_cpu_isa() != "scalar"


def _weight_storage(w: torch.Tensor, method: str, group_size: int) -> dict[str, object]:
    """The tensors a quantized `[out, in]` weight keeps, laid out for the product kernels of w's device.

    On a CPU with the C kernel: its tiles (`q`, `scale`, and `zero` for int4) under "kernel", the weight object the
    kernel takes. Otherwise on a CPU: int8 `q` + bfloat16 `scale` for `_weight_int8pack_mm`, int4 in PyTorch's packed
    layout with its `scales_and_zeros`. On a GPU: int8 `q` + `scale`, int4 as `pack_int4` bytes + `scale` + `zero`
    (group-wise), the layouts of minillm's Triton kernels. fp8: `q` (float8_e4m3fn) + float32 `scale` everywhere.
    """
    c_kernel = w.is_cpu and method in ("int8", "int4") and use_c_kernel() and w.shape[1] % 32 == 0
    if method == "int8":
        q, scale = quantize_int8(w, torch.bfloat16)
        if c_kernel:
            packed = pack_int8_cpu(q, scale)
            return {"q": packed.q, "scale": packed.scale, "kernel": packed}
        return {"q": q, "scale": scale.to(torch.bfloat16 if w.is_cpu else w.dtype)}
    if method == "int4":
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size {group_size} is not one of {INT4_GROUP_SIZES}")
        q, scale, zero = quantize_int4(w, group_size)
        if c_kernel:
            packed = pack_int4_cpu(q, scale, zero, group_size)
            return {"q": packed.q, "scale": packed.scale, "zero": packed.zero, "kernel": packed}
        if w.is_cpu:
            packed, scales_and_zeros = to_int4pack(q, scale, zero)
            return {"q": packed, "scale": scales_and_zeros.to(torch.bfloat16)}
        return {"q": pack_int4(q), "scale": scale.to(w.dtype), "zero": zero.to(w.dtype)}
    if method == "fp8":
        q, scale = quantize_fp8(w)
        return {"q": q, "scale": scale}
    raise ValueError(f"quantization {method!r} is not supported; use one of {QUANTIZATIONS}")


class QuantLinear(nn.Module):
    """A linear layer whose weight is stored in one of `QUANTIZATIONS`; used where `layers.Linear` was.

    On a CPU, int8 and int4 run minillm's C kernel (activations rounded to int8 per block of 32, integer dot
    products), or where it has no vector path PyTorch's packed kernels with bfloat16 activations (with float32 ones
    those are many times slower: `benchmarks/quant.py`); on a GPU they run minillm's Triton kernels, which
    dequantize inside the product. fp8 is dequantized at each call: a storage format here, not a fast path.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, method: str, group_size: int = 64):
        super().__init__()
        self.method, self.group_size = method, group_size
        self.out_features, self.in_features = weight.shape
        storage = _weight_storage(weight.detach(), method, group_size)
        # the C kernel's weight object (its tensors are also this module's buffers), or None
        self.kernel: Int4Weight | Int8Weight | None = storage.pop("kernel", None)
        self._matmul = None if self.kernel is None else bind(self.kernel)  # its arguments converted once
        for name, tensor in storage.items():
            self.register_buffer(name, tensor)
        self.bias = bias
        self.zero: torch.Tensor | None = getattr(self, "zero", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, method: str, group_size: int = 64) -> "QuantLinear":
        return cls(linear.weight, linear.bias, method, group_size)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight this layer computes with (for references and tests)."""
        if self.kernel is not None:  # an identity's rows are exact in int8, so this reads the weight back
            eye = torch.eye(self.in_features)
            out = torch.empty(self.in_features, self.out_features)
            return matmul_unchecked(eye, self.kernel, None, out).T.contiguous()
        if self.method == "int8":
            return dequantize_int8(self.q, self.scale.float())
        if self.method == "int4" and self.q.is_cpu:
            eye = torch.eye(self.in_features, dtype=torch.bfloat16)
            return int4_linear(eye, self.q, self.scale, self.group_size).float().T.contiguous()
        if self.method == "int4":
            return dequantize_int4(unpack_int4(self.q), self.scale.float(), self.zero.float())
        return dequantize_fp8(self.q, self.scale)

    @property
    def nbytes(self) -> int:
        """Bytes this layer's weight occupies (quantized values, scales and zero points)."""
        return sum(t.nbytes for t in (self.q, self.scale, self.zero) if t is not None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`x W^T + b` (plus `residual`), with x of any leading shape, in x's dtype."""
        shape, x2 = x.shape, x.reshape(-1, x.shape[-1])
        if self.kernel is not None and x.dtype == torch.float32 and self.bias is None:  # the residual add fused in
            x2, out = x2.contiguous(), torch.empty(x2.shape[0], self.out_features)
            r = None if residual is None else residual.reshape(-1, self.out_features).contiguous()
            self._matmul(x2.data_ptr(), None if r is None else r.data_ptr(), out.data_ptr(), x2.shape[0])
            return out if x.dim() == 2 else out.view(*shape[:-1], self.out_features)
        if self.kernel is not None:
            y = matmul_unchecked(x2.float().contiguous(), self.kernel, None,
                                 torch.empty(x2.shape[0], self.out_features)).to(x.dtype)
        elif self.method == "fp8":
            y = F.linear(x2, dequantize_fp8(self.q, self.scale).to(x.dtype))
        elif not x.is_cpu:
            from .kernels.quant_matmul import int4_matmul, int8_matmul

            y = (int8_matmul(x2, self.q, self.scale) if self.method == "int8"
                 else int4_matmul(x2, self.q, self.scale, self.zero, self.group_size))
        elif self.method == "int8":
            y = int8_linear(x2.to(torch.bfloat16), self.q, self.scale).to(x.dtype)
        else:
            y = int4_linear(x2.to(torch.bfloat16), self.q, self.scale, self.group_size).to(x.dtype)
        y = y.view(*shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None else y + residual


class QuantEmbedding(nn.Module):
    """The token embedding stored like a quantized weight: a lookup dequantizes only the rows it reads.

    The rows use the plain layouts (`q` int8 or fp8 with a scale per row; int4 as `pack_int4` bytes with a scale
    and zero per group), whatever the device: a lookup gathers rows, it does not run a product kernel.
    """

    def __init__(self, weight: torch.Tensor, method: str, group_size: int = 64):
        super().__init__()
        self.method, self.group_size, self.dtype = method, group_size, weight.dtype
        self.num_embeddings, self.embedding_dim = weight.shape
        w = weight.detach()
        if method == "int4":
            q, scale, zero = quantize_int4(w, group_size)
            self.register_buffer("q", pack_int4(q))
            self.register_buffer("zero", zero)
        else:
            q, scale = quantize_int8(w, torch.bfloat16) if method == "int8" else quantize_fp8(w)
            self.register_buffer("q", q)
            self.zero = None
        self.register_buffer("scale", scale)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.q, self.scale, self.zero) if t is not None)

    def dequantized_weight(self) -> torch.Tensor:
        """The whole float32 table (for references and tests)."""
        return self.forward(torch.arange(self.num_embeddings, device=self.q.device)).float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.method == "int4":
            rows = dequantize_int4(unpack_int4(self.q[input_ids]), self.scale[input_ids], self.zero[input_ids])
        else:
            rows = self.q[input_ids].float() * self.scale[input_ids, None]
        return rows.to(self.dtype)


def embedding_method(method: str) -> str:
    """The format of the token embedding and the head under `method`: int4 keeps them in int8, as GGUF files keep
    them in 8 or 6 bits. They are among the model's most sensitive matrices (chapter 6 measures what a 4-bit
    embedding and head cost, and one layer at a time) and a small share of a step's bytes."""
    return "int8" if method == "int4" else method


def quantize_model(model: nn.Module, method: str, group_size: int = 64, keep: tuple[str, ...] = ()) -> list[str]:
    """Quantize `model` in place: every linear layer in `method`, and the token embedding and head in
    `embedding_method(method)` (a tied head becomes a `QuantLinear` of the embedding matrix, quantized once for
    each use), except the modules named in `keep` (qualified names, e.g. "layers.0.mlp.down_proj",
    "embed_tokens", "lm_head"), which stay in the model's dtype (mixed precision). The float weights replaced are
    freed. Returns the names quantized."""
    from .layers import Linear

    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization {method!r} is not supported; use one of {QUANTIZATIONS}")
    names = dict(model.named_modules())
    unknown = [name for name in keep if name not in names and name != "lm_head"]
    if unknown:
        raise ValueError(f"keep names modules the model does not have: {unknown}")
    replaced = []
    for name, module in list(names.items()):
        if isinstance(module, Linear) and name not in keep:
            parent_name, _, attr = name.rpartition(".")
            fmt = embedding_method(method) if name == "lm_head" else method
            setattr(model.get_submodule(parent_name) if parent_name else model, attr,
                    QuantLinear.from_linear(module, fmt, group_size))
            replaced.append(name)
    embedding, outer = model.embed_tokens.weight, embedding_method(method)
    if model.lm_head is None and "lm_head" not in keep:  # the tied head: a product over the embedding matrix
        model.lm_head = QuantLinear(embedding, None, outer, group_size)
        model.packed_head = None
        replaced.append("lm_head")
    if "embed_tokens" not in keep:
        model.embed_tokens = QuantEmbedding(embedding, outer, group_size)
        replaced.append("embed_tokens")
    _release_float_storage(model)
    return replaced


def _release_float_storage(model: nn.Module) -> None:
    """Give each remaining parameter storage of its own: when the weights were loaded as slices of one block
    (`minillm.model._move_to_huge_pages`), the block, and every replaced weight in it, lives until no slice is left."""
    with torch.no_grad():
        for p in model.parameters():
            if p.untyped_storage().nbytes() > p.nbytes:
                p.data = p.data.clone()


def fake_quantize_model(model: nn.Module, method: str, group_size: int = 64, only: tuple[str, ...] | None = None
                        ) -> list[str]:
    """Round the float weights of `model`'s linear layers and token embedding (which a tied head shares) to a
    format's grid in place (`fake_quantize`); the model keeps its float kernels. For measuring what a format, a
    group size no kernel takes, or one layer at a time costs in accuracy. `only`: the module names to round."""
    from .layers import Linear, pack_weight

    targets = {name: m for name, m in model.named_modules()
               if isinstance(m, (Linear, nn.Embedding)) and (only is None or name in only)}
    if only is not None and len(targets) != len(set(only)):
        raise ValueError(f"no float linear layer or embedding named {sorted(set(only) - targets.keys())}")
    with torch.no_grad():
        for module in targets.values():
            module.weight.copy_(fake_quantize(module.weight, method, group_size))
            if getattr(module, "packed", None) is not None:
                module.pack()
        if getattr(model, "packed_head", None) is not None and "embed_tokens" in targets:
            model.packed_head = pack_weight(model.embed_tokens.weight)
    return list(targets)
