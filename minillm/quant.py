"""Chapter 6 — quantized layers: one class per weight format (int8 per output channel, int4 in groups with zero
points, fp8 e4m3) that stores a weight for its device's product kernel, runs the product and reads the weight
back, and the layers and `quantize_model` built on them (the formats' arithmetic is `minillm.quant_formats`).

What a kernel does with the activations is its own choice: see each format's `matmul`. On a CPU the products run
through minillm's C kernel (`kernels/int4_matmul.c`), or else PyTorch's packed kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`, whose int4 layout stores `(q - 8) * scale + zero'`, i.e. zero' = zero + 8 * scale);
on a GPU through minillm's Triton kernels (`kernels/quant_matmul.py`).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from .kernels.int4_cpu import (Int4Weight, Int8Weight, bind, int4_cpu_available, int4_cpu_isa, matmul_unchecked,
                               pack_int4_cpu, pack_int8_cpu)
from .quant_formats import (check_weight, dequantize_fp8, dequantize_int4, dequantize_int8, pack_int4, quantize_fp8,
                            quantize_int4, quantize_int8, unpack_int4)

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what PyTorch's packed int4 CPU kernel accepts
Stored = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Int4Weight | Int8Weight | None]


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


def use_c_kernel() -> bool:
    """Whether int8 and int4 products on a CPU go through minillm's C kernel (`kernels/int4_matmul.c`: integer dot
    products of the weight codes with int8-rounded activations, as llama.cpp computes): when it builds with a vector
    path for this CPU (its plain-C fallback is slower than PyTorch's kernels), unless `MINILLM_QUANT_KERNEL=torch`."""
    if os.environ.get("MINILLM_QUANT_KERNEL", "auto") == "torch":
        return False
    return int4_cpu_available() and int4_cpu_isa() != "scalar"


def _fits_c_kernel(w: torch.Tensor, group_size: int | None = None) -> bool:
    """Whether an int8 or int4 weight is stored for the C kernel: on a CPU that runs it, with inputs (and the
    groups sharing a scale, if any) in blocks of 32."""
    return w.is_cpu and use_c_kernel() and w.shape[1] % 32 == 0 and (group_size or 32) % 32 == 0


def _c_matmul(kernel: Int4Weight | Int8Weight, x: torch.Tensor) -> torch.Tensor:
    """x `[M, in]` @ the C kernel's weight transposed, in x's dtype (the kernel computes in float32)."""
    out = torch.empty(x.shape[0], kernel.out_features)
    return matmul_unchecked(x.float().contiguous(), kernel, None, out).to(x.dtype)


def _c_weight(kernel: Int4Weight | Int8Weight) -> torch.Tensor:
    """The float32 weight in the C kernel's layout: an identity's rows are exact in int8, so this reads it back."""
    eye, out = torch.eye(kernel.in_features), torch.empty(kernel.in_features, kernel.out_features)
    return matmul_unchecked(eye, kernel, None, out).T.contiguous()


class WeightFormat(ABC):
    """One quantized weight format (vLLM's quantization method, gpt-fast's `WeightOnlyInt8Linear`): how a weight
    `[out, in]` is rounded, stored for the product kernel of its device, multiplied and read back. The layer holds
    the stored tensors (`q`, `scale`, `zero`, and the C kernel's weight object as `kernel`); the format, what to
    do with them."""

    name: str
    default_group_size: int | None = None  # inputs sharing one scale when none is asked for; None: a whole row

    def __init__(self, group_size: int | None = None):
        self.group_size = self.default_group_size if group_size is None else group_size

    @abstractmethod
    def fake_quantize(self, w: torch.Tensor) -> torch.Tensor:
        """w rounded to the format's grid and back (float32)."""

    @abstractmethod
    def rows(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q, scale, zero or None) in the plain layout, from which any subset of rows dequantizes (an embedding's)."""

    @abstractmethod
    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """The float32 rows that `q`, `scale` and `zero` in the plain layout stand for."""

    @abstractmethod
    def store(self, w: torch.Tensor) -> Stored:
        """(q, scale, zero or None, the C kernel's weight or None): w laid out for the product kernel of w's device."""

    @abstractmethod
    def matmul(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        """x `[M, in]` @ the layer's weight transposed, `[M, out]` in x's dtype."""

    @abstractmethod
    def weight(self, layer: QuantLinear) -> torch.Tensor:
        """The float32 weight `[out, in]` the layer computes with (for references and tests)."""


class Int8(WeightFormat):
    """int8 per output channel, the scales rounded to bfloat16, or given a group size, per group of that many
    inputs (GGUF's Q8_0 with 32), the scales in float32. On a CPU: the C kernel (activations rounded to int8 per
    block of 32), else per channel PyTorch's `_weight_int8pack_mm` with bfloat16 activations; on a GPU per channel:
    Triton. Groups without the C kernel are dequantized at each product, like fp8."""

    name = "int8"

    def _rounded(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_int8(w, torch.bfloat16 if self.group_size is None else torch.float32, self.group_size)

    def fake_quantize(self, w: torch.Tensor) -> torch.Tensor:
        return dequantize_int8(*quantize_int8(w, group_size=self.group_size))

    def rows(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return (*self._rounded(w), None)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, zero: None) -> torch.Tensor:
        return dequantize_int8(q, scale.float())

    def store(self, w: torch.Tensor) -> Stored:
        q, scale = self._rounded(w)
        if _fits_c_kernel(w, self.group_size):
            packed = pack_int8_cpu(q, scale)
            return packed.q, packed.scale, None, packed
        if self.group_size is not None:
            return q, scale, None, None
        return q, scale.to(torch.bfloat16 if w.is_cpu else w.dtype), None, None

    def matmul(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        if layer.kernel is not None:
            return _c_matmul(layer.kernel, x)
        if self.group_size is not None:  # no kernel takes int8 groups here: dequantized, as fp8
            return F.linear(x, self.weight(layer).to(x.dtype))
        if not x.is_cpu:
            from .kernels.quant_matmul import int8_matmul

            return int8_matmul(x, layer.q, layer.scale)
        return int8_linear(x.to(torch.bfloat16), layer.q, layer.scale).to(x.dtype)

    def weight(self, layer: QuantLinear) -> torch.Tensor:
        return self.dequantize(layer.q, layer.scale, None) if layer.kernel is None else _c_weight(layer.kernel)


class Int4(WeightFormat):
    """int4 in groups of `group_size` inputs with a zero point (GGUF's Q4_1). On a CPU: the C kernel (activations
    rounded to int8 per block of 32), else PyTorch's `_weight_int4pack_mm_for_cpu` with bfloat16 activations; on a
    GPU: Triton, on `pack_int4` bytes."""

    name = "int4"
    default_group_size = 64

    def fake_quantize(self, w: torch.Tensor) -> torch.Tensor:
        """Any group size: a last group shorter than the others (128 does not divide 576) is filled out with copies
        of its last column, which leave its minimum and maximum alone."""
        check_weight(w)
        pad = -w.shape[1] % self.group_size
        padded = F.pad(w.float()[None], (0, pad), mode="replicate")[0] if pad else w
        return dequantize_int4(*quantize_int4(padded, self.group_size))[:, :w.shape[1]]

    def rows(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, scale, zero = quantize_int4(w, self.group_size)
        return pack_int4(q), scale, zero

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return dequantize_int4(unpack_int4(q), scale.float(), zero.float())

    def store(self, w: torch.Tensor) -> Stored:
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size {self.group_size} is not one of {INT4_GROUP_SIZES}")
        q, scale, zero = quantize_int4(w, self.group_size)
        if _fits_c_kernel(w, self.group_size):
            packed = pack_int4_cpu(q, scale, zero, self.group_size)
            return packed.q, packed.scale, packed.zero, packed
        if w.is_cpu:  # PyTorch's packed layout, the zero folded into its scales_and_zeros
            packed, scales_and_zeros = to_int4pack(q, scale, zero)
            return packed, scales_and_zeros.to(torch.bfloat16), None, None
        return pack_int4(q), scale.to(w.dtype), zero.to(w.dtype), None

    def matmul(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        if layer.kernel is not None:
            return _c_matmul(layer.kernel, x)
        if not x.is_cpu:
            from .kernels.quant_matmul import int4_matmul

            return int4_matmul(x, layer.q, layer.scale, layer.zero, self.group_size)
        return int4_linear(x.to(torch.bfloat16), layer.q, layer.scale, self.group_size).to(x.dtype)

    def weight(self, layer: QuantLinear) -> torch.Tensor:
        if layer.kernel is not None:
            return _c_weight(layer.kernel)
        if layer.q.is_cpu:  # PyTorch's packed layout, read back like the C kernel's
            eye = torch.eye(layer.in_features, dtype=torch.bfloat16)
            return int4_linear(eye, layer.q, layer.scale, self.group_size).float().T.contiguous()
        return self.dequantize(layer.q, layer.scale, layer.zero)


class Fp8(WeightFormat):
    """float8 e4m3 per output channel (whatever the group size), dequantized at each product: a storage format
    here, not a fast path."""

    name = "fp8"

    def fake_quantize(self, w: torch.Tensor) -> torch.Tensor:
        return dequantize_fp8(*quantize_fp8(w))

    def rows(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return (*quantize_fp8(w), None)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, zero: None) -> torch.Tensor:
        return dequantize_fp8(q, scale)

    def store(self, w: torch.Tensor) -> Stored:
        return (*self.rows(w), None)

    def matmul(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(layer).to(x.dtype))

    def weight(self, layer: QuantLinear) -> torch.Tensor:
        return self.dequantize(layer.q, layer.scale, None)


FORMATS: dict[str, type[WeightFormat]] = {f.name: f for f in (Int8, Int4, Fp8)}
QUANTIZATIONS = tuple(FORMATS)


def weight_format(method: str, group_size: int | None = None) -> WeightFormat:
    """The format named `method`, one of `QUANTIZATIONS`, with `group_size` inputs sharing a scale (None: the
    format's default, `WeightFormat.default_group_size`)."""
    if method not in FORMATS:
        raise ValueError(f"quantization {method!r} is not supported; use one of {QUANTIZATIONS}")
    return FORMATS[method](group_size)


def fake_quantize(w: torch.Tensor, method: str, group_size: int | None = None) -> torch.Tensor:
    """w rounded to `method`'s grid and back (float32): what a quantized layer computes with, for measuring a
    format's error without its kernel. int4 takes any group size (`Int4.fake_quantize`)."""
    return weight_format(method, group_size).fake_quantize(w)


class QuantLinear(nn.Module):
    """A linear layer whose weight is stored in one of `QUANTIZATIONS`; used where `layers.Linear` was.

    On a CPU, int8 and int4 run minillm's C kernel (activations rounded to int8 per block of 32, integer dot
    products), or where it has no vector path PyTorch's packed kernels with bfloat16 activations (with float32 ones
    those are many times slower: `benchmarks/quant.py`); on a GPU they run minillm's Triton kernels, which
    dequantize inside the product. fp8 is dequantized at each call: a storage format here, not a fast path.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, method: str, group_size: int | None = None):
        super().__init__()
        self.format = weight_format(method, group_size)
        self.out_features, self.in_features = weight.shape
        q, scale, zero, kernel = self.format.store(weight.detach())
        # the C kernel's weight object (its tensors are also this module's buffers), or None
        self.kernel: Int4Weight | Int8Weight | None = kernel
        self._matmul = None if kernel is None else bind(kernel)  # its arguments converted once
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, method: str, group_size: int | None = None) -> "QuantLinear":
        return cls(linear.weight, linear.bias, method, group_size)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight this layer computes with (for references and tests)."""
        return self.format.weight(self)

    @property
    def nbytes(self) -> int:
        """Bytes this layer's weight occupies (quantized values, scales and zero points)."""
        return sum(t.nbytes for t in (self.q, self.scale, self.zero) if t is not None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`x W^T + b` (plus `residual`), with x of any leading shape, in x's dtype; the product is the format's."""
        shape, x2 = x.shape, x.reshape(-1, x.shape[-1])
        if self.kernel is not None and x.dtype == torch.float32 and self.bias is None:  # the residual add fused in
            x2, out = x2.contiguous(), torch.empty(x2.shape[0], self.out_features)
            r = None if residual is None else residual.reshape(-1, self.out_features).contiguous()
            self._matmul(x2.data_ptr(), None if r is None else r.data_ptr(), out.data_ptr(), x2.shape[0])
            return out if x.dim() == 2 else out.view(*shape[:-1], self.out_features)
        y = self.format.matmul(self, x2).view(*shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None else y + residual


class QuantEmbedding(nn.Module):
    """The token embedding stored like a quantized weight: a lookup dequantizes only the rows it reads.

    The rows use the format's plain layout (`WeightFormat.rows`: int8 or fp8 with a scale per row, int4 as
    `pack_int4` bytes with a scale and zero per group), whatever the device: a lookup gathers rows, it does not run
    a product kernel.
    """

    def __init__(self, weight: torch.Tensor, method: str, group_size: int | None = None):
        super().__init__()
        self.format, self.dtype = weight_format(method, group_size), weight.dtype
        self.num_embeddings, self.embedding_dim = weight.shape
        q, scale, zero = self.format.rows(weight.detach())
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.q, self.scale, self.zero) if t is not None)

    def dequantized_weight(self) -> torch.Tensor:
        """The whole float32 table (for references and tests)."""
        return self.forward(torch.arange(self.num_embeddings, device=self.q.device)).float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        rows = self.format.dequantize(self.q[ids], self.scale[ids], None if self.zero is None else self.zero[ids])
        return rows.to(self.dtype).view(*input_ids.shape, self.embedding_dim)


def embedding_method(method: str) -> str:
    """The format of the token embedding and the head under `method`: int4 keeps them in int8, as GGUF files keep
    them in 8 or 6 bits. They are among the model's most sensitive matrices (chapter 6 measures what a 4-bit
    embedding and head cost, and one layer at a time) and a small share of a step's bytes."""
    return "int8" if method == "int4" else method


def quantize_model(model: nn.Module, method: str, group_size: int | None = None, keep: tuple[str, ...] = ()
                   ) -> list[str]:
    """Quantize `model` in place: every linear layer in `method` with `group_size` (None: the format's default),
    and the token embedding and head in `embedding_method(method)`, per output channel where that is another
    format (a tied head becomes a `QuantLinear` of the embedding matrix, quantized once for
    each use), except the modules named in `keep` (qualified names, e.g. "layers.0.mlp.down_proj",
    "embed_tokens", "lm_head"; a tied head only with its embedding), which stay in the model's dtype (mixed
    precision). The float weights replaced are freed. Returns the names quantized (a layer the loader quantized
    already is not among them)."""
    from .layers import Linear

    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization {method!r} is not supported; use one of {QUANTIZATIONS}")
    names = dict(model.named_modules())
    unknown = [name for name in keep if name not in names and name != "lm_head"]
    if unknown:
        raise ValueError(f"keep names modules the model does not have: {unknown}")
    if model.lm_head is None and "lm_head" in keep and "embed_tokens" not in keep:
        raise ValueError("the head is tied to the embedding (one matrix): to keep the head, keep 'embed_tokens' too")
    outer = embedding_method(method)
    outer_group = group_size if outer == method else None
    replaced = quantize_linears(model, method, group_size, keep + ("lm_head",))
    embedding = model.embed_tokens.weight
    if "lm_head" not in keep:
        if model.lm_head is None:  # the tied head: a product over the embedding matrix
            model.lm_head = QuantLinear(embedding, None, outer, outer_group)
            model.packed_head = None
            replaced.append("lm_head")
        elif isinstance(model.lm_head, Linear):
            model.lm_head = QuantLinear.from_linear(model.lm_head, outer, outer_group)
            replaced.append("lm_head")
    if "embed_tokens" not in keep:
        model.embed_tokens = QuantEmbedding(embedding, outer, outer_group)
        replaced.append("embed_tokens")
    _release_float_storage(model)
    return replaced


def quantize_linears(module: nn.Module, method: str, group_size: int | None = None, keep: tuple[str, ...] = ()
                     ) -> list[str]:
    """Replace every float linear layer inside `module` (qualified names not in `keep`) by a `QuantLinear` in
    `method`; the names replaced. The loader calls it on each decoder layer as soon as its weights are in, so that
    a whole float copy of a quantized model never exists."""
    from .layers import Linear

    replaced = []
    for name, linear in list(module.named_modules()):
        if isinstance(linear, Linear) and name not in keep:
            parent_name, _, attr = name.rpartition(".")
            setattr(module.get_submodule(parent_name) if parent_name else module, attr,
                    QuantLinear.from_linear(linear, method, group_size))
            replaced.append(name)
    return replaced


def _release_float_storage(model: nn.Module) -> None:
    """Give each remaining parameter storage of its own: when the weights were loaded as slices of one block
    (`minillm.model._move_to_huge_pages`), the block, and every replaced weight in it, lives until no slice is left."""
    with torch.no_grad():
        for p in model.parameters():
            if p.untyped_storage().nbytes() > p.nbytes:
                p.data = p.data.clone()


def fake_quantize_model(model: nn.Module, method: str, group_size: int | None = None,
                        only: tuple[str, ...] | None = None
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
