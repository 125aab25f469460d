"""The fused decode step of a quantized model on a CPU against the same model stepped layer by layer, both against
the bare weight products of their batch, in one run.

For each format and batch size, that many requests with distinct random prompts of `--context` tokens are
prefilled; then rounds alternate the two ways of stepping the same engine (the fused step, `decode_step.c`, and
the modules of `model.py`, `model.use_fused_step = False`), each engine step followed at once by one bare step
(`matvec_step(model, batch)`: the model's own products and head for `[batch, in]` inputs, nothing else).
Reported: median ms per step, bare/step (the paired median of the per-step ratios, with its quartiles) and the
fused step's speed-up, which is layer-by-layer time over fused time, paired by round. Also the bytes a step
reads: its weights (what the bare step reads too) and its KV cache (what attention reads, and the bare step does
not); weights / (weights + KV) is the share the products would have if every byte moved at the same speed, a
bound on bare/fused for a step that is bound by its reads.

    .venv/bin/python -m benchmarks.fused_step [--formats int4 int8] [--batches 1 16 32] [--threads 1]
                                              [--kv-cache-dtype int8] [--save FILE.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_batch import paired_steps, prefill
from benchmarks.record import add_threads_option, save_json, use_threads
from minillm import LLM
from minillm.roofline import matvec_step, step_weight_bytes

TARGET = 0.85  # bare/step of the fused step at batch 16 and 32


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fused_step", description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=["int4", "int8"], choices=["int4", "int8"])
    parser.add_argument("--group-size", type=int, default=None, help="inputs per scale (default: the format's)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                        help="the cache's format: float32 (auto) or int8 with a scale per vector")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="paired decode steps per way and round")
    add_threads_option(parser)
    parser.add_argument("--save", type=Path, default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    use_threads(args)
    steps_per_request = 2 * args.rounds * (args.steps + 2) + max(args.batches) * args.context // 2048 + 8
    blocks = int(1.1 * max(args.batches) * (args.context + steps_per_request) / 16) + 64
    print(f"{torch.get_num_threads() if not args.threads else args.threads} threads; context {args.context}; "
          f"{args.kv_cache_dtype if args.kv_cache_dtype != 'auto' else 'float32'} KV cache; "
          f"{args.rounds} rounds of {args.steps} paired steps per way; ms per step (medians)")
    print(f"{'format':>6} {'batch':>5} {'fused':>7} {'modules':>8} {'bare':>7} {'bare/fused':>17} "
          f"{'bare/modules':>17} {'speed-up':>8} {'fused tok/s':>11} {'weights MB':>10} {'KV MB':>6} "
          f"{'bytes bound':>11}")
    misses, rows = [], []
    for fmt in args.formats:
        llm = LLM(quantization=fmt, quantization_group_size=args.group_size, max_num_seqs=max(args.batches),
                  enable_prefix_caching=False, num_kv_blocks=blocks, kv_cache_dtype=args.kv_cache_dtype)
        engine, gen = llm.engine, torch.Generator().manual_seed(0)
        model = engine.model
        if model.fused_decode(engine.kv_cache) is None:
            print(f"{fmt}: no fused step here (the C kernels need a vector path)")
            continue
        for batch in args.batches:
            ids = prefill(engine, batch, args.context, gen)
            weights_mb = step_weight_bytes(model) / 1e6
            cache = engine.kv_cache  # bytes per token: every layer's K and V (and their scales in an int8 pool)
            per_token = cache.nbytes / (cache.num_blocks * cache.block_size)
            kv_mb = sum(s.num_cached_tokens + 1 for s in engine.scheduler.running) * per_token / 1e6  # first step
            bare = matvec_step(model, batch)
            times = {True: ([], []), False: ([], [])}  # fused? -> (step times, bare times)
            speedups = []
            for r in range(args.rounds):
                order = (True, False) if r % 2 == 0 else (False, True)
                medians = {}
                for fused in order:
                    model.use_fused_step = fused
                    paired_steps(engine, bare, 1)  # the first step after a switch warms the caches
                    step_s, bare_s = paired_steps(engine, bare, args.steps)
                    times[fused][0].extend(step_s)
                    times[fused][1].extend(bare_s)
                    medians[fused] = statistics.median(step_s)
                speedups.append(medians[False] / medians[True])
            model.use_fused_step = True
            for rid in ids:
                engine.abort(rid)
            ratios = {f: [b / e for e, b in zip(*times[f])] for f in (True, False)}  # bare/step, step by step
            share = {f: statistics.median(ratios[f]) for f in (True, False)}
            cells = []
            for fused in (True, False):
                q = statistics.quantiles(ratios[fused], n=4)
                cells.append(f"{share[fused]:5.2f} ({q[0]:.2f}-{q[2]:.2f})")
            fused_ms, modules_ms = (1e3 * statistics.median(times[f][0]) for f in (True, False))
            bare_ms = 1e3 * statistics.median(times[True][1] + times[False][1])
            print(f"{fmt:>6} {batch:5d} {fused_ms:7.2f} {modules_ms:8.2f} {bare_ms:7.2f} {cells[0]:>17} "
                  f"{cells[1]:>17} {statistics.median(speedups):7.2f}x {1e3 * batch / fused_ms:11.1f} "
                  f"{weights_mb:10.1f} {kv_mb:6.1f} {weights_mb / (weights_mb + kv_mb):11.2f}", flush=True)
            rows.append({"format": fmt, "batch": batch, "fused_ms": fused_ms, "modules_ms": modules_ms,
                         "bare_ms": bare_ms, "bare_over_fused": share[True], "bare_over_modules": share[False],
                         "speedup": statistics.median(speedups), "weights_mb": weights_mb, "kv_mb": kv_mb})
            if batch in (16, 32) and share[True] < TARGET:
                misses.append(f"{fmt} batch {batch}")
        del llm, engine, model
    if any(batch in (16, 32) for batch in args.batches):
        print(f"target bare/fused >= {TARGET} at batch 16 and 32: {'met' if not misses else f'missed: {misses}'}")
    if args.save:
        save_json(args.save, threads=torch.get_num_threads(), torch=torch.__version__, context=args.context,
                  kv_cache_dtype=args.kv_cache_dtype, group_size=args.group_size, rounds=args.rounds,
                  steps=args.steps, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
