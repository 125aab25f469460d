"""Exercise 0: RMSNorm and rotary position embeddings (RoPE)."""
