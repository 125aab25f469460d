"""A submission whose Q4_1 decoder is the gguf package's, reached through its top-level re-export: it would earn
the decoder's points, but reference.py's FORBIDDEN bars `gguf.quants`, so `python -m exercises.selfcheck`
requires it to score 0. The other functions are the untouched stub's."""

import gguf
import numpy as np
import torch

from exercises.ch06_quantization.int4 import *  # noqa: F403


def decode_q4_1(raw: bytes) -> torch.Tensor:
    if len(raw) % 20:
        raise ValueError(f"{len(raw)} bytes is not a whole number of 20-byte Q4_1 blocks")
    blocks = np.frombuffer(raw, dtype=np.uint8)
    return torch.from_numpy(gguf.dequantize(blocks, gguf.GGMLQuantizationType.Q4_1)).reshape(-1)
