"""Chapter 4 — how many threads PyTorch's CPU operations get: all cores but one by default, all of them where
OpenMP's waiting threads sleep (`OMP_WAIT_POLICY=PASSIVE`, which `python -m minillm` sets),
`MINILLM_NUM_THREADS` to choose, and a count the program already chose is kept.

A decode step on a CPU is a chain of a few hundred operations, and every one of them waits for the slowest
of its threads. When another process (the server's HTTP front end, a notebook, the operating system) takes
one of the cores, the thread that was running there stalls every operation after it, so a step with a thread
for every core can run several times slower than one that left a core free. `benchmarks/threads.py` measures
this on the chat and rag workloads; chapter 4 shows the numbers. OpenMP's threads spin while they wait for
work; told to sleep instead (`OMP_WAIT_POLICY=PASSIVE`), a thread team with every core kept most of its gain on
a quiet machine and lost nothing against one thread beside a busy neighbour (`benchmarks/results/threads.txt`),
so where that policy holds the default is every core.
"""

from __future__ import annotations

import os

import torch

ENV = "MINILLM_NUM_THREADS"
_expected = torch.get_num_threads()  # the count minillm last saw or set; anything else was the program's choice
# OpenMP reads its wait policy once, when PyTorch loads: this is what it read, unless the policy changed between
# PyTorch's import and this module's
_PASSIVE = os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and `taskset` narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def passive_wait() -> bool:
    """Whether OpenMP's waiting threads sleep in this process (`OMP_WAIT_POLICY=PASSIVE` when PyTorch loaded)."""
    return _PASSIVE


def default_num_threads() -> int:
    """The engine's choice when `$MINILLM_NUM_THREADS` is unset: every available core where waiting threads sleep
    (`passive_wait()`), else every core but one (at least one), so that spinning threads cannot stall each step."""
    cores = available_cores()
    return cores if passive_wait() else max(1, cores - 1)


def num_threads() -> int:
    """`$MINILLM_NUM_THREADS` if set, else `default_num_threads()`."""
    value = os.environ.get(ENV)
    if value is None:
        return default_num_threads()
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"${ENV}={value!r}; expected a whole number of threads, at least 1")
    return int(value)


def chosen_by_program() -> bool:
    """Whether the program already picked PyTorch's thread count: `torch.set_num_threads` since minillm was
    imported, or `$OMP_NUM_THREADS`. The engine keeps such a choice rather than quietly replacing it."""
    return "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() != _expected


def engine_threads(n: int | None = None) -> int:
    """The count an engine gets: `n` if given, else `$MINILLM_NUM_THREADS`, else the program's own choice if it
    made one, else `default_num_threads()`."""
    if n is not None:
        return n
    if ENV not in os.environ and chosen_by_program():
        return torch.get_num_threads()
    return num_threads()


def configure_threads(n: int | None = None) -> int:
    """Give PyTorch's CPU operations `engine_threads(n)` threads (the engine does this when built)."""
    global _expected
    n = engine_threads(n)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    _expected = n
    return n
