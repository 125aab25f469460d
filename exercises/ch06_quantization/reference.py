"""The minillm code this exercise rebuilds (the grader's reference; not a copy).

`int4_matmul` is minillm's Triton kernel, compiled on a GPU (the grader's CPU tensors go there and back) and run
by Triton's interpreter on a CPU. It is imported on first call, because triton is a Linux-only dependency that
the other names do not need; FORBIDDEN bars its module, which reference.py does not import at load.
`quantization_error` measures minillm's `fake_quantize`, as chapter 6 does.
"""

import torch

from minillm.gguf_blocks import decode_q4_1
from minillm.quant import fake_quantize
from minillm.quant_formats import dequantize_int4, pack_int4, quantize_int4, unpack_int4

__all__ = ["quantize_int4", "dequantize_int4", "pack_int4", "unpack_int4", "decode_q4_1", "int4_matmul",
           "quantization_error"]
GRADED = __all__  # every name is the student's to write
FORBIDDEN = ("gguf.quants", "minillm.kernels.quant_matmul")  # gguf's block decoders; minillm's int4 kernel


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                group_size: int) -> torch.Tensor:
    from minillm.kernels import int4_matmul as kernel

    device = torch.device("cuda") if torch.cuda.is_available() else x.device
    return kernel(*(t.to(device) for t in (x, packed, scale, zero)), group_size).to(x.device)


def quantization_error(w: torch.Tensor, group_sizes: list[int]) -> dict[int, float]:
    w = w.float()
    return {g: float((fake_quantize(w, "int4", g) - w).norm() / w.norm()) for g in group_sizes}
