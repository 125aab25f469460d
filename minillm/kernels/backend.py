"""Chapter 5 — which attention path runs: Triton kernels (compiled on a GPU, interpreted on a CPU) or plain
PyTorch.

Triton compiles for GPUs only; on a machine without CUDA its interpreter (`TRITON_INTERPRET=1`) runs the
same kernel source with numpy, one program instance after another: slow, but exact enough to test with.
The variable must be set before any kernel is decorated, so this module sets it on import when CUDA is absent.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

# triton reads TRITON_INTERPRET when it is first imported (transformers' model classes import it too):
# if that happened before this module, the variable set here comes too late for this process
_IMPORTED_TOO_EARLY = "triton" in sys.modules and "TRITON_INTERPRET" not in os.environ
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ENV = "MINILLM_ATTENTION"  # "auto" (default), "triton" or "torch"


def _choice() -> str:
    choice = os.environ.get(ENV, "auto").lower()
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"${ENV}={choice!r}; expected 'auto', 'triton' or 'torch'")
    return choice


def triton_available() -> bool:
    """Whether the `triton` package is installed (it is a Linux-only dependency)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter rather than compiled for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and not _IMPORTED_TOO_EARLY


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input_precision: float32 through three TF32 products (about float32's accuracy on Tensor
    Cores, where plain "tf32" keeps only 10 mantissa bits); 16-bit types multiply exactly anyway."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def use_triton(device: torch.device | str | None = None) -> bool:
    """True when attention should run through minillm's Triton kernels on `device` (default: CUDA if present).

    `$MINILLM_ATTENTION` decides: "torch" never, "triton" always (on a CPU that means the interpreter, for
    tests and teaching), "auto" (unset) on CUDA devices only.
    """
    choice = _choice()
    device_type = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "torch" or (choice == "auto" and device_type != "cuda"):
        return False
    if not triton_available():
        if choice == "triton":
            raise RuntimeError(f"${ENV}=triton but the triton package is not installed (pip install triton)")
        return False
    if device_type == "cpu" and not interpreting():
        raise RuntimeError(f"${ENV}=triton on a CPU needs TRITON_INTERPRET=1 set before triton is imported "
                           "(import minillm before transformers' model classes, which import triton)")
    return True


def use_cpu_kernel(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True when decode attention should run through the C kernel (`minillm.kernels.cpu`): on a CPU, for a
    float32 or int8 KV pool (`dtype`), with `$MINILLM_ATTENTION` unset or "auto", and when the kernel builds on
    this machine."""
    if _choice() != "auto" or torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.int8):
        return False
    from .cpu import cpu_kernel_available

    return cpu_kernel_available()
