"""Chapter 2 — CPU memory backed by 2 MiB pages, for the weights that every decode step streams through.

A batch-1 decode step on a CPU reads every weight once: with the usual 4 KiB pages that is a page
translation for every 4 KiB of weights. Asking the kernel for transparent huge pages (`madvise(MADV_HUGEPAGE)`)
cuts the translations 512-fold. Chapter 2 measures what that buys, and the engine leaves it off unless
`MINILLM_HUGE_PAGES=1`: a float32 step on a CPU reads oneDNN's packed copies of the weights (a quantized one, its
packed codes), which live outside this block, and in virtual machines that back guest memory lazily, faulting
2 MiB pages in can stall a load now and then. Where the platform offers no huge pages this is plain
memory.
"""

from __future__ import annotations

import mmap
import os

import torch


def use_huge_pages() -> bool:
    """Whether CPU weights go into huge-page memory: only when `MINILLM_HUGE_PAGES=1` asks for it."""
    return os.environ.get("MINILLM_HUGE_PAGES", "0") == "1"


def huge_page_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of `numel` elements in memory advised to use huge pages."""
    if not hasattr(mmap, "MAP_PRIVATE"):  # not a POSIX system
        return torch.empty(numel, dtype=dtype)
    buffer = mmap.mmap(-1, max(numel * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)  # before the first touch, so pages are faulted in at 2 MiB
    return torch.frombuffer(buffer, dtype=dtype, count=numel)  # the tensor keeps the mapping alive
