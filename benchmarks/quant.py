"""Weight-only quantized products against the engine's float32 ones, for the default model's own weights, in one run.

For every linear layer of a decode step (and the tied head), times the whole step's products at a batch size
through: the engine's float32 path (oneDNN-packed weights), int8 (`_weight_int8pack_mm`) and int4 group-wise
(`_weight_int4pack_mm_for_cpu`), each with float32 and with bfloat16 activations. Variants alternate round
by round; the table gives medians and the speed-up over float32.

    .venv/bin/python -m benchmarks.quant [--batches 1 16] [--rounds 5] [--group-size 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm import LLM, quant, threads
from minillm.roofline import decode_linears


def step_products(model, batch: int, group_size: int) -> dict[str, object]:
    """name -> a function running every product of one decode step in that format."""
    linears = decode_linears(model)
    weights = [lin.weight.detach() for lin in linears] + [model.embed_tokens.weight.detach()]
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}
    int8 = [quant.quantize_int8(w) for w in weights]
    int4 = [(quant.to_int4pack(*quant.quantize_int4(w, group_size))) for w in weights]

    def fp32():
        for lin in linears:
            lin.forward(inputs[lin.in_features])
        model.logits(inputs[model.config.hidden_size])

    def int8_step(dtype):
        xs = {k: v.to(dtype) for k, v in inputs.items()}
        return lambda: [quant.int8_linear(xs[w.shape[1]], q, s) for w, (q, s) in zip(weights, int8)]

    def int4_step(dtype):
        xs = {k: v.to(dtype) for k, v in inputs.items()}
        return lambda: [quant.int4_linear(xs[w.shape[1]], p, sz, group_size) for w, (p, sz) in zip(weights, int4)]

    return {"float32 (oneDNN packed)": fp32, "int8, fp32 activations": int8_step(torch.float32),
            "int8, bf16 activations": int8_step(torch.bfloat16), "int4, fp32 activations": int4_step(torch.float32),
            "int4, bf16 activations": int4_step(torch.bfloat16)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quant", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="PyTorch CPU threads (0 = the engine's default)")
    args = parser.parse_args(argv)
    if args.threads:
        os.environ[threads.ENV] = str(args.threads)
    llm = LLM(enable_prefix_caching=False, num_kv_blocks=16)
    print(f"{llm.engine.device}, {torch.get_num_threads()} thread(s); int4 group size {args.group_size}; "
          f"ms per decode step's products (30 layers + head), median of {args.rounds} rounds")
    with torch.inference_mode():
        for batch in args.batches:
            variants = step_products(llm.engine.model, batch, args.group_size)
            times: dict[str, list[float]] = {name: [] for name in variants}
            for fn in variants.values():
                fn()  # warm-up
            for _ in range(args.rounds):
                for name, fn in variants.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            base = statistics.median(times["float32 (oneDNN packed)"])
            print(f"batch {batch}:")
            for name, t in times.items():
                print(f"  {name:26} {1e3 * statistics.median(t):8.1f} ms   {base / statistics.median(t):5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
