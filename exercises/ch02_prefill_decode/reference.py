"""The minillm functions this exercise rebuilds (the grader's reference; not a copy)."""

from minillm.roofline import (OpCost, arithmetic_intensity, decode_costs, forward_costs, prefill_costs, ridge_point,
                              total_bytes, total_flops)

__all__ = ["OpCost", "forward_costs", "prefill_costs", "decode_costs", "total_flops", "total_bytes",
           "arithmetic_intensity", "ridge_point"]
GRADED = [n for n in __all__ if n != "OpCost"]  # given: the stub imports it
