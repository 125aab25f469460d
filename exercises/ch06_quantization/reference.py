"""The minillm functions this exercise rebuilds (the grader's reference; not a copy)."""

from minillm.gguf_blocks import decode_q4_1
from minillm.quant import dequantize_int4, pack_int4, quantize_int4, unpack_int4

__all__ = ["quantize_int4", "dequantize_int4", "pack_int4", "unpack_int4", "decode_q4_1"]
GRADED = __all__  # every name is the student's to write
