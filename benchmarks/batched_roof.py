"""Batched int4 decode steps against both of their floors: the bytes floor and the arithmetic floor.

`benchmarks/scaling.py` compares a step at batch 16 or 32 with its bytes floor (weights and KV read once at the
measured read bandwidth). A step at batch B also does B multiply-adds per weight, and the C kernel does them as
8-bit integer dot products (`minillm/kernels/int4_matmul.c`), so a second floor is those multiply-adds at the
CPU's peak rate for those instructions with the same threads (`minillm.roofline.measure_int8_peak`: independent
accumulators, nothing read from memory). Printed per batch: the step and its bare weight products
(`matvec_step`), both floors, and the products' multiply-add rate as a share of the peak, all measured in one
run. Where the kernel takes groups of 16 rows to AMX tiles (`int4_cpu_amx`), each batch is measured both ways,
alternated round by round in the same engine, each against the peak of its own instructions (AMX's tile product,
or the vector loop's). Chapter 6.7 measures the same at the chapter's one thread.

    .venv/bin/python -m benchmarks.batched_roof [--batches 1 16 32] [--threads 2] [--steps 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import add_threads_option, use_threads
from minillm import LLM
from minillm.kernels.int4_cpu import int4_cpu_amx, int4_cpu_isa
from minillm.roofline import (matvec_step, measure_bandwidth, measure_int8_peak, paired_steps, running_step_bytes,
                              start_decoding, step_macs, step_weight_bytes)

CONTEXT = 64  # tokens of each request's prompt, as scaling.py's batched steps
ROUNDS = 3  # alternations of the kernel's two ways per batch, where it has two


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.batched_roof", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--steps", type=int, default=12, help="paired decode steps per batch (and way)")
    add_threads_option(parser)
    args = parser.parse_args(argv)
    use_threads(args)

    tokens = max(args.batches) * (CONTEXT + args.steps + 16)
    llm = LLM(quantization="int4", max_num_seqs=max(args.batches), enable_prefix_caching=False,
              num_kv_blocks=int(1.1 * tokens / 16) + 64)
    engine, gen = llm.engine, torch.Generator().manual_seed(0)
    ways = {"amx": True, "vector": False} if int4_cpu_amx() else {int4_cpu_isa(): None}
    peaks = {way: measure_int8_peak(amx=amx) for way, amx in ways.items()}
    bandwidth = measure_bandwidth("read")
    weights = step_weight_bytes(engine.model)
    print(f"int4, {torch.get_num_threads()} threads, kernel {int4_cpu_isa()}; 8-bit multiply-add peak "
          + ", ".join(f"{peak / 1e9:.0f} G/s ({way})" for way, peak in peaks.items())
          + f"; read bandwidth {bandwidth / 1e9:.1f} GB/s; {weights / 1e6:.1f} MB of weights a step")
    print(f"{'batch':>5} {'kernel':>7} {'step ms':>8} {'products':>8} {'bytes floor':>11} {'arith floor':>11} "
          f"{'step/bytes':>10} {'step/max':>8} {'products/peak':>13}")
    for batch in args.batches:
        ids = start_decoding(engine, batch, CONTEXT, gen)
        bare = matvec_step(engine.model, batch)
        times = {way: ([], []) for way in ways}
        rounds = ROUNDS if len(ways) > 1 else 1
        for _ in range(rounds):
            for way, amx in ways.items():
                if amx is not None:
                    int4_cpu_amx(amx)
                paired_steps(engine, bare, 2)  # warm-up at this batch and way
                steps, products = paired_steps(engine, bare, max(1, args.steps // rounds))
                times[way][0].extend(steps), times[way][1].extend(products)
        bytes_floor = running_step_bytes(engine) / bandwidth
        for rid in ids:
            engine.abort(rid)
        macs = step_macs(engine.model, batch)
        for way, (steps, products) in times.items():
            step, prod = statistics.median(steps), statistics.median(products)
            arith_floor = macs / peaks[way]
            print(f"{batch:5d} {way:>7} {1e3 * step:8.2f} {1e3 * prod:8.2f} {1e3 * bytes_floor:11.2f} "
                  f"{1e3 * arith_floor:11.2f} {step / bytes_floor:10.2f} {step / max(bytes_floor, arith_floor):8.2f} "
                  f"{macs / prod / peaks[way]:13.2f}", flush=True)
    if len(ways) > 1:
        int4_cpu_amx(True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
