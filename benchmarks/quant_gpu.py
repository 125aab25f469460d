"""A decode step's weight products on a GPU: bf16 `F.linear` against minillm's int8 and int4 Triton kernels.

First the products of one SmolLM2-135M decode step (30 layers of qkv 576->960, o 576->576, gate_up 576->3072,
down 1536->576, and the 576->49152 head), then single layers of an 8B-class model (4096->4096, 4096->14336,
14336->4096) in enough copies that they do not fit in L2, all with random weights; int4 in groups of 64,
with float32 scales and zeros and with bfloat16 ones. For M = 1, 16, 64 tokens the table gives ms per step,
GB/s of weight bytes read (values, scales and zeros) and the speed-up over bf16, each a median of rounds in
which the variants alternate. "graph" replays each step as a CUDA graph (the GPU's time); "eager" launches
from Python, as minillm's engine does, so launch costs count too.

    python benchmarks/quant_gpu.py [--rounds 30] [--tokens 1 16 64]   (GPU only; on a CPU it exits 0)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm.quant_formats import pack_int4, quantize_int4, quantize_int8  # noqa: E402

GROUP = 64
SMOLLM2_LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate_up, down
SMOLLM2 = SMOLLM2_LAYER * 30 + [(49152, 576)]
L2_BEATING_BYTES = 512 << 20  # bf16 bytes of copies of one large layer: well above any L2


def formats(shapes: list[tuple[int, int]]) -> dict[str, list[tuple]]:
    """Each format's weights for every (out, in) shape: the tensors its product reads."""
    weights = {"bf16": [], "int8": [], "int4": [], "int4 bf16 s/z": []}
    for n, k in shapes:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, scale = quantize_int8(w)
        q4, scale4, zero4 = quantize_int4(w, GROUP)
        packed = pack_int4(q4)
        weights["bf16"].append((w,))
        weights["int8"].append((q, scale.to(torch.bfloat16)))
        weights["int4"].append((packed, scale4, zero4))
        weights["int4 bf16 s/z"].append((packed, scale4.to(torch.bfloat16), zero4.to(torch.bfloat16)))
    return weights


def step(name: str, weights: list[tuple], xs: dict[int, torch.Tensor]):
    """A function running every product of one step in one format."""
    from minillm.kernels import int4_matmul, int8_matmul

    if name == "bf16":
        return lambda: [F.linear(xs[w.shape[1]], w) for (w,) in weights]
    if name == "int8":
        return lambda: [int8_matmul(xs[q.shape[1]], q, s) for q, s in weights]
    return lambda: [int4_matmul(xs[2 * p.shape[1]], p, s, z, GROUP) for p, s, z in weights]


def as_graph(fn):
    """fn captured once as a CUDA graph; the returned function replays it."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def median_ms(fns: dict[str, object], rounds: int) -> dict[str, float]:
    """Median ms of each function, timed with CUDA events in rounds that alternate the order of the functions."""
    names = list(fns)
    events = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[name]()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in events.items()}


def max_relative_error(weights: dict[str, list[tuple]], x: torch.Tensor) -> dict[str, float]:
    """Each format's largest deviation from the float32 product with its own dequantized weight (first layer)."""
    from minillm.kernels import int4_matmul, int8_matmul
    from minillm.kernels.reference import int4_matmul_ref, int8_matmul_ref

    errors = {}
    for name, ws in weights.items():
        if name == "bf16":
            continue
        out, want = ((int8_matmul(x, *ws[0]), int8_matmul_ref(x.float(), *ws[0])) if name == "int8"
                     else (int4_matmul(x, *ws[0], GROUP), int4_matmul_ref(x.float(), *ws[0], GROUP)))
        errors[name] = ((out.float() - want).abs().max() / want.abs().max()).item()
    return errors


def table(title: str, shapes: list[tuple[int, int]], copies: int, tokens: list[int], rounds: int) -> None:
    """Time every format on `copies` copies of `shapes` at each token count; ms are per copy."""
    weights = formats(shapes * copies)
    nbytes = {name: sum(t.nbytes for ws in w for t in ws) for name, w in weights.items()}
    print(f"\n{title}: weight bytes read per copy " + ", ".join(f"{name} {b / copies / 1e6:.1f} MB"
                                                              for name, b in nbytes.items()))
    heads = [f"{name + ' ms':>17} {'GB/s':>5}" + ("" if name == "bf16" else " x bf16") for name in weights]
    print(f"{'M':>4} {'timing':>6} | " + " | ".join(heads))
    for m in tokens:
        xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, k in shapes}
        eager = {name: step(name, ws, xs) for name, ws in weights.items()}
        for fn in eager.values():  # compile and autotune before anything is timed or captured
            fn()
        torch.cuda.synchronize()
        for timing, fns in [("graph", {name: as_graph(fn) for name, fn in eager.items()}), ("eager", eager)]:
            ms = median_ms(fns, rounds)
            cells = [f"{ms[name] / copies:17.4f} {nbytes[name] / ms[name] / 1e6:5.0f}"
                     + ("" if name == "bf16" else f" {ms['bf16'] / ms[name]:6.2f}") for name in fns]
            print(f"{m:4d} {timing:>6} | " + " | ".join(cells))
    x = torch.randn(16, shapes[0][1], device="cuda", dtype=torch.bfloat16)
    print("max |error| / max |output| against the float32 product with the same quantized weight: "
          + ", ".join(f"{name} {e:.1e}" for name, e in max_relative_error(formats(shapes[:1]), x).items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/quant_gpu.py: skipped, it needs a CUDA GPU (tests/test_quant_kernels.py checks the "
              "kernels' results on a CPU, in Triton's interpreter)")
        return 0
    import triton

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    torch.manual_seed(0)
    table(f"SmolLM2-135M decode step ({len(SMOLLM2)} products)", SMOLLM2, 1, args.tokens, args.rounds)
    for n, k in [(4096, 4096), (14336, 4096), (4096, 14336)]:
        copies = math.ceil(L2_BEATING_BYTES / (2 * n * k))
        table(f"one {k}->{n} layer (timed over {copies} copies)", [(n, k)], copies, args.tokens, args.rounds)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
