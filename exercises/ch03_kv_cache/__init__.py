"""Exercise 3: a contiguous KV cache for one layer, and the KV-cache size formula."""
