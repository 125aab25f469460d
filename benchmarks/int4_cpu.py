"""SmolLM2-135M's weight products in int4 and int8 on a CPU: minillm's C kernel against PyTorch's.

Three workloads, each run through its variants in turn:
  int4 step  the 121 products of a decode step (30 layers of qkv 576->960, o 576->576, gate_up 576->3072,
             down 1536->576; random weights quantized in groups of 32): the C kernel (`int4_matmul_cpu`, float32
             activations quantized to int8 inside, and `matmul_unchecked`, the same without its checks),
             PyTorch's `_weight_int4pack_mm_for_cpu` with bfloat16 activations (`minillm.quant.int4_linear`) and
             float32 oneDNN (`minillm.layers.packed_linear`)
  int8 step  the same products with int8 weights per output channel: `int8_matmul_cpu`, `matmul_unchecked` and
             PyTorch's `_weight_int8pack_mm` with bfloat16 activations (`minillm.quant.int8_linear`); and
             `matmul_unchecked` with int8 in groups of 32 (GGUF's Q8_0), a float32 scale each
  int8 head  the tied output layer, 576->49152, in int8 the same three ways
Variants alternate round by round; medians are printed with the weight bytes each variant reads per second, of
wall time and, for a machine shared with other work, of the calling thread's CPU time (with one thread every
variant runs in that thread).

    .venv/bin/python -m benchmarks.int4_cpu [--workloads int4 int8 head] [--batches 1 16 384] [--rounds 15]
                                            [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm.kernels.int4_cpu import (int4_cpu_isa, int4_matmul_cpu, int8_matmul_cpu, matmul_unchecked,
                                      pack_int4_cpu, pack_int8_cpu)
from minillm.layers import pack_weight, packed_linear
from minillm.quant import int4_linear, int8_linear, to_int4pack
from minillm.quant_formats import quantize_int4, quantize_int8

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in] of qkv, o, gate_up, down
HEAD = (49152, 576)  # the tied embedding as output layer
LAYERS, GROUP = 30, 32

Variants = dict[str, tuple[object, int]]  # name -> (function of a dict {in_features: x}, weight bytes it reads)


def random_weights(shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=gen) * 0.05 for shape in shapes]


def unchecked(xs: dict[int, torch.Tensor], weights: list) -> None:
    """Every product through `matmul_unchecked`, each into a new output as a caller would allocate it."""
    for w in weights:
        x = xs[w.in_features]
        matmul_unchecked(x, w, None, torch.empty(x.shape[0], w.out_features))


def int4_variants(shapes: list[tuple[int, int]]) -> Variants:
    weights = random_weights(shapes)
    quantized = [quantize_int4(w, GROUP) for w in weights]
    ours = [pack_int4_cpu(*qsz, GROUP) for qsz in quantized]
    theirs = [tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in to_int4pack(*qsz))
              for qsz in quantized]
    fp32 = [pack_weight(w) for w in weights]

    def c_kernel(xs):
        for w in ours:
            int4_matmul_cpu(xs[w.in_features], w)

    def torch_int4(xs):
        for w, (packed, sz) in zip(weights, theirs):
            int4_linear(xs[w.shape[1]].to(torch.bfloat16), packed, sz, GROUP)

    def onednn_fp32(xs):
        for w, packed in zip(weights, fp32):
            packed_linear(xs[w.shape[1]], packed)

    ours_bytes = sum(w.nbytes for w in ours)
    return {"C int4 (int8 x)": (c_kernel, ours_bytes),
            "C int4 unchecked": (lambda xs: unchecked(xs, ours), ours_bytes),
            "torch int4 (bf16 x)": (torch_int4, sum(p.nbytes + sz.nbytes for p, sz in theirs)),
            "oneDNN fp32": (onednn_fp32, sum(w.nbytes for w in weights))}


def int8_variants(shapes: list[tuple[int, int]]) -> Variants:
    weights = random_weights(shapes)
    quantized = [quantize_int8(w, torch.bfloat16) for w in weights]
    ours = [pack_int8_cpu(*qs) for qs in quantized]
    grouped = [pack_int8_cpu(*quantize_int8(w, group_size=GROUP)) for w in weights]
    theirs = [(q, scale.to(torch.bfloat16)) for q, scale in quantized]

    def c_kernel(xs):
        for w in ours:
            int8_matmul_cpu(xs[w.in_features], w)

    def torch_int8(xs):
        for q, scale in theirs:
            int8_linear(xs[q.shape[1]].to(torch.bfloat16), q, scale)

    ours_bytes = sum(w.nbytes for w in ours)
    return {"C int8 (int8 x)": (c_kernel, ours_bytes),
            "C int8 unchecked": (lambda xs: unchecked(xs, ours), ours_bytes),
            f"C int8 G={GROUP} unchecked": (lambda xs: unchecked(xs, grouped), sum(w.nbytes for w in grouped)),
            "torch int8 (bf16 x)": (torch_int8, sum(q.nbytes + scale.nbytes for q, scale in theirs))}


WORKLOADS = {"int4": lambda: int4_variants(SHAPES * LAYERS), "int8": lambda: int8_variants(SHAPES * LAYERS),
             "head": lambda: int8_variants([HEAD])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 384])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"kernel: {int4_cpu_isa()}, threads: {args.threads}, products per step: {LAYERS * len(SHAPES)}")
    for workload in args.workloads:
        variants = WORKLOADS[workload]()
        for batch in args.batches:
            xs = {k: torch.randn(batch, k) for k in {shape[1] for shape in SHAPES}}
            rounds = args.rounds if batch <= 64 else max(3, args.rounds // 5)
            wall, cpu = ({name: [] for name in variants} for _ in range(2))
            with torch.inference_mode():
                for _ in range(rounds + 1):  # the first round warms up
                    for name, (fn, _) in variants.items():
                        start, start_cpu = time.perf_counter(), time.thread_time()
                        fn(xs)
                        wall[name].append(time.perf_counter() - start)
                        cpu[name].append(time.thread_time() - start_cpu)
            for name, (_, nbytes) in variants.items():
                ms, cpu_ms = (statistics.median(t[name][1:]) * 1e3 for t in (wall, cpu))
                print(f"{workload:4s} M={batch:4d}  {name:20s} {ms:9.2f} ms {nbytes / ms / 1e6:5.1f} GB/s   "
                      f"cpu {cpu_ms:9.2f} ms {nbytes / cpu_ms / 1e6:5.1f} GB/s   ({nbytes / 1e6:.1f} MB of weights)")


if __name__ == "__main__":
    main()
