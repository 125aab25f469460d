"""The minillm functions this exercise rebuilds (the grader's reference; not a copy)."""

from minillm.layers import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq

__all__ = ["rms_norm", "rope_inv_freq", "rope_cos_sin", "apply_rope"]
GRADED = __all__  # every name is the student's to write
