"""Batched decode steps against the bare weight products of the same batch, at two context lengths, in one run.

For each context length and batch size, that many requests with distinct random prompts of that length are
prefilled; then every engine decode step is followed at once by one bare step (`matvec_step(model, batch)`:
the model's own weight products for `[batch, in]` inputs and nothing else), and bare/engine is the median of
the per-step ratios. Steps alternate between the engine as it runs (a float32 model's layers in one C++ call on a
CPU, `kernels/decode_layers.py`) and the same model stepped layer by layer through `model.py`'s modules
(`model.use_fused_step = False`), each paired with its own bare step. The bare products leave attention out, so even
an engine that did nothing else would stay below
the "bytes cap": bare / (bare + the step's cached keys and values read at the machine's measured read bandwidth).
Attention is timed on its own, over all layers
of the same cache and block tables: the engine's C kernel (reads keys and values in place), the same kernel
over an int8 copy of the pool (`kv_cache_dtype="int8"`: a quarter of the bytes, plus a scale per vector),
PyTorch's gather-then-SDPA (`MINILLM_ATTENTION=torch`), and SDPA over contiguous copies of the same keys and
values, the floor an unpaged cache would give. On a CPU a second table says where a step's time goes when it runs
layer by layer, timed in place while the engine steps: the products, the head, the norms, attention, SiLU times up,
the rest of the forward pass (Python between the operations, the embedding) and the engine around it (scheduling,
sampling, bookkeeping); the one-call step leaves only its products, attention and the small operations' arithmetic.

    .venv/bin/python -m benchmarks.decode_batch [--contexts 64 512] [--batches 1 4 16 32 64] [--steps 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import add_threads_option, use_threads
import minillm.layers
import minillm.model
from minillm import LLM
from minillm.attention import _Part, cpu_decode_attention, decode_attention, quantize_kv
from minillm.roofline import alternated_steps, matvec_step, measure_bandwidth, running_kv_bytes, start_decoding

TARGET = 0.85  # bare/engine at every batch up to TARGET_BATCH at the shortest context
TARGET_BATCH = 32


def attention_times(engine, rounds: int = 5) -> dict[str, float]:
    """Seconds per step (all layers) of decode attention for the running batch, four ways, alternated."""
    seqs = engine.scheduler.running
    cfg, kv = engine.config, engine.kv_cache
    width = max(len(s.block_table) for s in seqs)
    part = _Part(torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32),
                 torch.tensor([s.num_cached_tokens for s in seqs], dtype=torch.int32), [1] * len(seqs))
    q = torch.randn(len(seqs), cfg.num_heads, cfg.head_dim)
    scale, group = cfg.head_dim ** -0.5, cfg.num_heads // cfg.num_kv_heads
    layers = [kv.layer(i) for i in range(cfg.num_layers)]
    probe = _Part(part.block_tables, part.context_lens, part.query_lens)
    decode_attention(q, *layers[0], probe, scale)  # works out the gather slots and padding mask
    contiguous = [tuple(cache.view(-1, cfg.num_kv_heads, cfg.head_dim)[probe.gather_slots].transpose(1, 2).contiguous()
                        for cache in layer) for layer in layers]  # [seqs, kv_heads, longest, head_dim] each
    q4 = q.view(len(seqs), cfg.num_kv_heads, group, cfg.head_dim)
    int8 = [tuple(quantize_kv(cache, torch.int8) for cache in layer) for layer in layers]  # ((k, k_scale), (v, v_scale))

    def c_kernel():
        for k, v in layers:
            cpu_decode_attention(q, k, v, part, scale)

    def c_kernel_int8():
        for (k, k_scale), (v, v_scale) in int8:
            cpu_decode_attention(q, k, v, part, scale, k_scale, v_scale)

    def torch_gather():
        fresh = _Part(part.block_tables, part.context_lens, part.query_lens)  # slots worked out once per step
        for k, v in layers:
            decode_attention(q, k, v, fresh, scale)

    def contiguous_sdpa():
        for k, v in contiguous:
            F.scaled_dot_product_attention(q4, k, v, attn_mask=probe.mask, scale=scale)

    variants = {"C kernel": c_kernel, "C kernel, int8 K/V": c_kernel_int8, "torch gather+SDPA": torch_gather,
                "contiguous SDPA": contiguous_sdpa}
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, fn in variants.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def step_parts(engine, steps: int) -> dict[str, float]:
    """Median seconds per decode step of `engine`'s running batch, stepped layer by layer, in each of its parts (see
    the module's docstring), each call of a part wrapped in a timer while `steps` steps run (which adds about a
    microsecond a call). Read on a CPU: on a GPU the timers would see kernel launches, not their work."""
    model, totals, running = engine.model, defaultdict(float), set()  # running: the parts being timed now

    def timed(name: str, fn):
        def wrapper(*args, **kwargs):
            if running - {"forward"}:  # a part inside another (an untied head's product): counted in the outer one
                return fn(*args, **kwargs)
            running.add(name)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start
                running.discard(name)
        return wrapper

    parts = {"products": (minillm.layers.Linear, "product"), "head": (type(model), "logits"),
             "norms": (minillm.layers.RMSNorm, "forward"), "attention": (minillm.model, "cpu_decode_layer"),
             "SiLU*up": (minillm.model, "silu_and_mul"), "forward": (engine.runner, "execute")}
    per_step: dict[str, list[float]] = defaultdict(list)
    with ExitStack() as stack:
        for name, (owner, attr) in parts.items():
            stack.enter_context(mock.patch.object(owner, attr, timed(name, getattr(owner, attr))))
        stack.enter_context(mock.patch.object(model, "use_fused_step", False))
        for _ in range(steps):
            totals.clear()
            start = time.perf_counter()
            engine.step()
            step = time.perf_counter() - start
            timed_inside = sum(totals[name] for name in parts if name != "forward")
            for name in parts:
                per_step[name].append(totals[name])
            per_step["rest of forward"].append(totals["forward"] - timed_inside)
            per_step["engine"].append(step - totals["forward"])
            per_step["step"].append(step)
    return {name: statistics.median(times) for name, times in per_step.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_batch", description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--steps", type=int, default=12, help="paired decode steps per (context, batch)")
    add_threads_option(parser)
    args = parser.parse_args(argv)
    use_threads(args)

    prefill_steps = max(args.batches) * max(args.contexts) // 2048 + 1  # steps the early requests decode meanwhile
    tokens = max(args.batches) * (max(args.contexts) + 4 * args.steps + prefill_steps + 8)
    llm = LLM(max_num_seqs=max(args.batches), enable_prefix_caching=False, num_kv_blocks=int(1.1 * tokens / 16) + 64)
    engine, gen = llm.engine, torch.Generator().manual_seed(0)
    bandwidth = measure_bandwidth("read", device=engine.device)
    print(f"{engine.device}, {str(engine.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, "
          f"{bandwidth / 1e9:.1f} GB/s read; "
          f"decode attention: {'C kernel' if engine.runner.use_cpu_kernel else 'PyTorch'}; "
          f"{args.steps} paired steps per row and way; ms per step, attention summed over {engine.config.num_layers} "
          f"layers; by layer: bare/engine stepped layer by layer")
    print(f"{'context':>7} {'batch':>5} {'engine':>8} {'bare':>8} {'bare/engine':>17} {'by layer':>8} {'bytes cap':>9}   "
          f"{'attn: C kernel':>14} {'C int8 K/V':>10} {'torch gather':>12} {'contiguous':>10}")
    misses, breakdown = [], []
    for context in args.contexts:
        for batch in args.batches:
            ids = start_decoding(engine, batch, context, gen)
            bare = matvec_step(engine.model, batch)
            alternated_steps(engine, bare, 2)  # warm-up at this shape, both ways
            attention = attention_times(engine)
            kv_bytes = running_kv_bytes(engine)  # at the first paired step
            ways = alternated_steps(engine, bare, args.steps)
            engine_times, bare_times = ways[True]
            by_layer = statistics.median(b / e for e, b in zip(*ways[False]))
            if engine.device.type == "cpu":
                breakdown.append((context, batch, step_parts(engine, args.steps)))
            for rid in ids:
                engine.abort(rid)
            ratios = [b / e for e, b in zip(engine_times, bare_times)]
            q = statistics.quantiles(ratios, n=4)
            ratio, bare_s = statistics.median(ratios), statistics.median(bare_times)
            cap = bare_s / (bare_s + kv_bytes / bandwidth)
            print(f"{context:7d} {batch:5d} {1e3 * statistics.median(engine_times):8.1f} "
                  f"{1e3 * bare_s:8.1f} {ratio:5.2f} ({q[0]:.2f}-{q[2]:.2f}) {by_layer:8.2f} {cap:9.3f}   "
                  f"{1e3 * attention['C kernel']:14.1f} {1e3 * attention['C kernel, int8 K/V']:10.1f} "
                  f"{1e3 * attention['torch gather+SDPA']:12.1f} "
                  f"{1e3 * attention['contiguous SDPA']:10.1f}", flush=True)
            if context == min(args.contexts) and batch <= TARGET_BATCH and ratio < TARGET:
                misses.append((batch, cap))
    if breakdown:
        names = ["step", "products", "head", "norms", "attention", "SiLU*up", "rest of forward", "engine"]
        print("\nwhere a step's time goes layer by layer, timed in place (ms per step, medians):")
        print(f"{'context':>7} {'batch':>5} " + " ".join(f"{name:>15}" for name in names))
        for context, batch, parts in breakdown:
            print(f"{context:7d} {batch:5d} " + " ".join(f"{1e3 * parts[name]:15.2f}" for name in names))
    missed = ", ".join(f"{batch} (bytes cap {cap:.3f})" for batch, cap in misses)
    print(f"target bare/engine >= {TARGET} at every batch up to {TARGET_BATCH} at context {min(args.contexts)}: "
          f"{'met' if not misses else f'missed at batch {missed}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
