"""The minillm functions this exercise rebuilds (the grader's reference; not a copy)."""

from minillm.kernels.online_softmax import merge_partials, partial_attention, tiled_attention

__all__ = ["partial_attention", "merge_partials", "tiled_attention"]
GRADED = __all__  # every name is the student's to write
