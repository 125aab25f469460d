"""Exercise 2: FLOPs, bytes and arithmetic intensity of prefill and decode."""
