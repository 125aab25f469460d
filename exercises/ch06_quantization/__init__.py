"""Exercise 6: group-wise int4 quantization, packing two weights per byte, and GGUF's Q4_1 blocks."""
