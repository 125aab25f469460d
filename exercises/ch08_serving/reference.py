"""The minillm code this exercise rebuilds (the grader's reference; not a copy). The grader never calls it."""

from minillm.stop_strings import StopStringFilter, held_back

__all__ = ["held_back", "StopStringFilter"]
GRADED = __all__  # every name is the student's to write
