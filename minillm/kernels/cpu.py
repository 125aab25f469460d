"""Chapter 4 — the CPU decode kernel: paged attention in C (`paged_decode.c`), compiled at first use and called
through ctypes.

PyTorch has no attention over a paged cache, so its decode path first copies each sequence's keys and values
out of the pool (`index_select`) and then runs SDPA over the copy: the context is read twice and written
once. At batch 32 that copy costs as much as the attention itself. The C kernel reads every key and value
row where it lies, once. It is built with the machine's C compiler (`$CC`, default `cc`) for this CPU
(`-march=native`, or the target `$MINILLM_CPU_MARCH` names, e.g. `x86-64-v3` for AVX2 without AVX-512, so
one machine can check the code another CPU would run; vectorized `expf` from glibc's libmvec) into the cache
directory, and shares PyTorch's OpenMP runtime, so `torch.set_num_threads` sets its threads too. Without a compiler the PyTorch path runs.
An int8 pool (chapter 6's quantized KV cache) is read the same way, a quarter of the bytes, each vector
dequantized with its scale as it is read.

A decode step layer by layer calls `rope_store_decode_unchecked` once per layer: RoPE, the cache store and the
kernel in one call, where three would each run after a weight product had pushed the previous one's data out of
the processor's caches (on a 2-core Xeon it took a float32 batch-1 step from 0.76-0.77 of its bare weight
products' speed to 0.82-0.83, two runs each of `benchmarks/decode_batch.py`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from ..cache_dir import cache_dir

SOURCE = Path(__file__).with_name("paged_decode.c")
COMPILE_FLAGS = ["-O3", f"-march={os.environ.get('MINILLM_CPU_MARCH', 'native')}", "-ffast-math", "-fopenmp", "-fPIC"]
# Linked without -ffast-math: a shared library linked with it sets flush-to-zero for the whole process.
LINK_FLAGS = ["-shared", "-fopenmp"]


def _source_text(source: Path) -> bytes:
    """The C file's text followed by that of the files it includes with quotes (so editing either rebuilds it)."""
    text = source.read_bytes()
    for name in re.findall(rb'^#include "([^"]+)"', text, re.MULTILINE):
        text += _source_text(source.parent / name.decode())
    return text


def _cached_build(source: Path, directory: Path, flags: list[str], commands) -> Path:
    """`source` built once into `directory` as `<stem>_<key>.so`, the key a hash of its text (with the text of what
    it includes with quotes) and of `flags`; `commands(tmp, out)` lists the commands that build it at `out`, in the
    temporary folder `tmp`. Built aside, then renamed: safe for parallel builds. Raises where a command fails."""
    key = hashlib.sha256(_source_text(source) + " ".join(flags).encode()).hexdigest()[:16]
    library = directory / f"{source.stem}_{key}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        out = Path(tmp) / library.name
        for cmd in commands(Path(tmp), out):
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(out, library)
    return library


def _build(source: Path, directory: Path) -> Path:
    """Compile and link the C file `source` into `directory` (cached, see `_cached_build`); its path."""
    compiler = os.environ.get("CC", "cc")

    def commands(tmp: Path, out: Path) -> list[list[str]]:
        obj = tmp / f"{source.stem}.o"
        return [[compiler, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)],
                [compiler, *LINK_FLAGS, str(obj), "-o", str(out), "-lmvec", "-lm"]]

    return _cached_build(source, directory, [compiler, *COMPILE_FLAGS, *LINK_FLAGS], commands)


def build_and_load(source: Path) -> ctypes.CDLL | None:
    """The C file `source` compiled for this machine (cached) and loaded, or None where it cannot be built (no
    compiler, not Linux/glibc)."""
    try:
        return ctypes.CDLL(str(_build(source, cache_dir() / "kernels")))
    except (OSError, subprocess.CalledProcessError):
        return None


def build_torch_library(source: Path) -> Path | None:
    """The C++ file `source`, which registers PyTorch operators, built (cached) against this PyTorch's headers and
    libraries with the machine's C++ compiler (`$CXX`, default `c++`), for `torch.ops.load_library`; None where it
    does not build here."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    flags = ["-O2", "-shared", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             *(f"-I{p}" for p in cpp_extension.include_paths()), *(f"-L{p}" for p in cpp_extension.library_paths()),
             *(f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu", "-ltorch"]
    try:
        return _cached_build(source, cache_dir() / "kernels", [compiler, *flags, torch.__version__],
                             lambda tmp, out: [[compiler, str(source), "-o", str(out), *flags]])
    except (OSError, subprocess.CalledProcessError):
        return None


def _declare(lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    """The attention kernels' signatures on a loaded build of SOURCE."""
    if lib is not None:
        lib.paged_decode_f32.restype = lib.paged_decode_i8.restype = None
        lib.paged_decode_f32.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64]
        lib.paged_decode_i8.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64]
        lib.rope_store_decode.restype = None
        lib.rope_store_decode.argtypes = [ctypes.c_void_p] * 11 + [ctypes.c_int64] * 6 + [ctypes.c_float]
    return lib


@functools.cache
def _library():
    """The compiled kernels, or None when they cannot be built here."""
    return _declare(build_and_load(SOURCE))


def cpu_kernel_available() -> bool:
    """Whether the C decode kernel is built (building it now if needed) and loadable on this machine."""
    return _library() is not None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(scale * q K^T) V for one query token per sequence, `q: [seqs, heads, dim]` (float32, CPU), over
    the first `context_lens[s]` cached tokens of each sequence, read through `block_tables` from the paged
    `[blocks, block_size, kv_heads, dim]` caches: float32, or int8 with float32 scales `k_scale`, `v_scale`
    `[blocks, block_size, kv_heads]` (one per vector). Equals `minillm.attention.decode_attention`."""
    if _library() is None:
        raise RuntimeError("the C decode kernel could not be built here (is a C compiler installed?)")
    quantized = k_cache.dtype == torch.int8
    if not all(t.device.type == "cpu" for t in (q, k_cache, v_cache)) or q.dtype != torch.float32 \
            or k_cache.dtype != v_cache.dtype or k_cache.dtype not in (torch.float32, torch.int8) \
            or not (k_cache.is_contiguous() and v_cache.is_contiguous() and q[0].is_contiguous()):
        raise ValueError("paged_decode_attention takes float32 CPU queries, float32 or int8 caches, the caches "
                         "contiguous and each sequence's query heads contiguous")
    if quantized != (k_scale is not None and v_scale is not None) or quantized and not all(
            s.dtype == torch.float32 and s.is_contiguous() and s.shape == k_cache.shape[:3] for s in (k_scale, v_scale)):
        raise ValueError("an int8 pool needs float32 scales k_scale and v_scale shaped [blocks, block_size, kv_heads] "
                         "(contiguous), and a float32 pool none")
    seqs, heads, dim = q.shape
    blocks, block_size, kv_heads, _ = k_cache.shape
    if heads % kv_heads or k_cache.shape[3] != dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    if tables.shape[0] != seqs or lens.shape != (seqs,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} "
                         f"must have one row per sequence ({seqs})")
    if lens.numel() and (int(lens.min()) < 1 or int(lens.max()) > tables.shape[1] * block_size):
        raise ValueError("every context length must be at least 1 and fit in its block table")
    if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= blocks):
        raise ValueError(f"block_tables name blocks outside the cache's {blocks}")
    return paged_decode_unchecked(q, k_cache, v_cache, tables, lens, scale, k_scale, v_scale)


def paged_decode_unchecked(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                           lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_decode_attention` without its checks, for the engine, whose metadata is built to fit (int32
    `tables` and `lens`, contiguous): checking at every layer would cost more than the kernel saves at batch 1."""
    seqs, heads, dim = q.shape
    out = torch.empty(seqs, heads, dim)
    caches = [k_cache.data_ptr(), v_cache.data_ptr()]
    if k_scale is None:
        fn = _library().paged_decode_f32
    else:
        fn, caches = _library().paged_decode_i8, caches + [k_scale.data_ptr(), v_scale.data_ptr()]
    fn(q.data_ptr(), *caches, tables.data_ptr(), lens.data_ptr(), out.data_ptr(), seqs, heads, k_cache.shape[2], dim,
       k_cache.shape[1], tables.shape[1], scale, q.stride(0))
    return out


def rope_store_decode_unchecked(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, slots: torch.Tensor,
                                k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                                num_heads: int, scale: float, k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's attention in a decode-only step from its q/k/v product `qkv` `[seqs, (heads + 2 kv_heads) dim]`
    (contiguous float32; rotated in place): RoPE by each token's `cos` and `sin_signed` rows (`[seqs, dim]`), its
    keys and values into cache slots `slots` (int64), then `paged_decode_unchecked` over the pool. The same
    arithmetic as `layers.rotate`, `attention.store_kv` and the kernel called one after another (equal to the
    bit), in one call: `[seqs, heads, dim]`. Unchecked, for the engine."""
    seqs, dim = qkv.shape[0], k_cache.shape[3]
    out = torch.empty(seqs, num_heads, dim)
    scales = (None, None) if k_scale is None else (k_scale.data_ptr(), v_scale.data_ptr())
    _library().rope_store_decode(qkv.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), slots.data_ptr(),
                                 k_cache.data_ptr(), v_cache.data_ptr(), *scales, tables.data_ptr(), lens.data_ptr(),
                                 out.data_ptr(), seqs, num_heads, k_cache.shape[2], dim, k_cache.shape[1],
                                 tables.shape[1], scale)
    return out
