"""Chapter 1 — notebook workloads sized to the machine (small on a 2-core CPU, realistic on a GPU), and the one
way every chapter sets up its timing and says where it ran."""

from __future__ import annotations

import importlib.metadata
import os
import platform

import torch

from . import threads

ON_GPU = torch.cuda.is_available()


def size(cpu, gpu):
    """One knob of a workload: the `cpu` value on a machine without CUDA, the `gpu` value on one with it."""
    return gpu if ON_GPU else cpu


def setup_chapter() -> str:
    """Time every chapter the same way, and return one line saying where it ran.

    On a CPU, PyTorch gets one thread: with several, a matrix product waits for its slowest thread, and on
    a shared machine that is often the one the operating system paused, so timings jump (chapter 1
    measures this). Timings in the book are medians of repeated runs (`minillm.roofline.time_median`).
    """
    if not ON_GPU:
        os.environ[threads.ENV] = "1"  # so that engines built in the chapter keep to one thread too
        torch.set_num_threads(1)
    return describe_machine()


def describe_machine() -> str:
    """CPU model, cores and PyTorch threads, memory, GPU, and library versions, in one line."""
    parts = [f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} PyTorch "
             f"thread{'s' * (torch.get_num_threads() != 1)}", f"{_memory_gib():.0f} GiB RAM"]
    if ON_GPU:
        props = torch.cuda.get_device_properties(0)
        parts.append(f"GPU {props.name} ({props.total_memory / 2 ** 30:.0f} GiB)")
    else:
        parts.append("no GPU")
    versions = [f"torch {torch.__version__}"]
    try:
        versions.append(f"triton {importlib.metadata.version('triton')}")
    except importlib.metadata.PackageNotFoundError:
        pass
    return "Ran on: " + "; ".join(parts + [", ".join(versions)])


def cpu_model() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    try:  # Linux
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return float("nan")
