"""Exercise 1: serving metrics (TTFT, TPOT, ITL, E2EL, percentiles, goodput) from raw request records."""
