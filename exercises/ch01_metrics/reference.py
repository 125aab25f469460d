"""The minillm functions this exercise rebuilds (the grader's reference; not a copy)."""

from minillm.metrics import RequestMetrics, e2el, goodput, itl, meets_slo, percentile, summarize, tpot, ttft

__all__ = ["RequestMetrics", "ttft", "tpot", "itl", "e2el", "percentile", "meets_slo", "goodput", "summarize"]
GRADED = [n for n in __all__ if n != "RequestMetrics"]  # given: the grader builds records with it
