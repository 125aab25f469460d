"""A submission whose int4 product is minillm's Triton kernel, imported inside the function: it would earn the
product's points, but reference.py's FORBIDDEN bars `minillm.kernels.quant_matmul`, so
`python -m exercises.selfcheck` requires it to score 0. The other functions are the untouched stub's."""

import torch

from exercises.ch06_quantization.int4 import *  # noqa: F403


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                group_size: int) -> torch.Tensor:
    from minillm.kernels import int4_matmul as kernel

    return kernel(x, packed, scale, zero, group_size)
