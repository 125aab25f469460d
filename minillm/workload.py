"""Notebook workloads sized to the machine: small enough for a 2-core CPU, realistic on a GPU."""

from __future__ import annotations

import torch

ON_GPU = torch.cuda.is_available()


def size(cpu, gpu):
    """One knob of a workload: the `cpu` value on a machine without CUDA, the `gpu` value on one with it."""
    return gpu if ON_GPU else cpu
