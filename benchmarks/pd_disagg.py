"""Prefill/decode disaggregation on the default model, measured against one engine doing both (chapter 9).

(a) What a transfer moves and how long it takes: bytes per prompt token against the formula layers x 2 x KV heads
x head dim x bytes, and the decode side's pull time (and GB/s) by prompt length, over the pair's gloo group on
127.0.0.1. (b) A mixed workload, long prompts arriving among running decoders, replayed open loop into one engine
with 2 threads, one engine with 1 thread, and a `PDPair` with 1 + 1 threads: the decoders' ITL P99 and goodput
under an SLO. (c) The inequality "disaggregation pays when the interference it removes exceeds the transfer it
adds", with this machine's measurements for a short and a long prompt, and by formula for GPUs (data-sheet
bandwidths, an H200's FLOP roofline).

Everything runs in one invocation, one configuration after another; run it on an otherwise idle machine. Usage:

    .venv/bin/python -m benchmarks.pd_disagg [--decoders 4] [--long-len 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm import LLMEngine, SamplingParams
from minillm.bench import corpus_ids, replay
from minillm.config import ModelConfig
from minillm.disagg import PDPair
from minillm.kv_cache import LLAMA3_70B, kv_cache_bytes
from minillm.metrics import summarize
from minillm.roofline import prefill_costs, total_bytes, total_flops
from minillm.weights import resolve_model
from minillm.workload import describe_machine

# Data-sheet figures, not measurements: NVIDIA H200 SXM (dense bf16 tensor cores, HBM3e), and links per direction.
H200_FLOPS, H200_BYTES_S = 989e12, 4.8e12
LINKS = {"NVLink 4 (900 GB/s both ways)": 450e9, "PCIe 5.0 x16": 64e9, "InfiniBand NDR 400 Gb/s": 50e9}


def windows(ids: list[int], lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Windows of the packaged text at distinct offsets, so no two prompts share a cached prefix."""
    starts = random.Random(seed).sample(range(len(ids) - max(lengths)), len(lengths))
    return [ids[start:start + n] for start, n in zip(starts, lengths)]


def transfer_sizes(pair: PDPair, prompts: list[list[int]], lengths: list[int], repeats: int,
                   config: ModelConfig) -> dict:
    """(a) One request per prompt length and repeat, alone (the prefill side idle when the pull comes), after one
    that opens gloo's connections; the transfer records of both sides. Returns the median pull seconds by length."""
    per_token = kv_cache_bytes(1, config.num_layers, config.num_kv_heads, config.head_dim, 4)
    pair.generate([prompts[-1][:16]], SamplingParams(max_tokens=2, ignore_eos=True))
    pair.reset_prefix_cache()  # the measured requests find nothing cached on either side
    seen = len(pair.instance_stats()["decode"][0]["transfers"])
    for prompt in prompts:
        pair.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
    (prefill,), (decode,) = pair.instance_stats().values()
    records = decode["transfers"][seen:]
    served = {r.request_id: r.seconds for r in prefill["transfers"]}
    print(f"\n(a) KV transfer by prompt length, float32 cache, block size 16; formula: {config.num_layers} layers x 2 x "
          f"{config.num_kv_heads} KV heads x {config.head_dim} x 4 bytes = {per_token:,} bytes per token")
    print(f"{'tokens':>6} {'blocks':>6} {'bytes':>12} {'bytes/token':>12} {'x formula':>9} {'pull ms':>8} "
          f"{'GB/s':>6} {'prefill side ms':>15}  (medians of {repeats}; the prefill side: gather and send)")
    medians = {}
    for i, n in enumerate(lengths):
        mine = records[i * repeats:(i + 1) * repeats]
        seconds = statistics.median(r.seconds for r in mine)
        r = mine[0]
        assert all(x.nbytes == r.nbytes == r.num_blocks * 16 * per_token for x in mine), "bytes differ from formula"
        medians[n] = seconds
        serve = statistics.median(served[x.request_id] for x in mine)
        print(f"{n:>6} {r.num_blocks:>6} {r.nbytes:>12,} {r.nbytes / n:>12,.0f} {r.nbytes / n / per_token:>9.3f} "
              f"{1e3 * seconds:>8.2f} {r.nbytes / seconds / 1e9:>6.2f} {1e3 * serve:>15.2f}")
    return medians


def mixed_workload(prompts: list[list[int]], decoders: int, decode_tokens: int, longs: int, long_tokens: int,
                   first_long: float, gap: float):
    """Decoders arriving together at the start, then long prompts every `gap` seconds while they decode."""
    params = [SamplingParams(max_tokens=decode_tokens, ignore_eos=True)] * decoders + \
             [SamplingParams(max_tokens=long_tokens, ignore_eos=True)] * longs
    arrivals = [0.0] * decoders + [first_long + i * gap for i in range(longs)]
    return prompts, params, arrivals


def run_mixed(engine, name: str, work, decoders: int, slo: dict) -> dict:
    """(b) Replay the workload open loop into an engine or a pair; print and return its summary."""
    prompts, params, arrivals = work
    outs = replay(engine, prompts, params, arrivals)
    records = [o.metrics for o in outs]
    dec, longs, every = summarize(records[:decoders]), summarize(records[decoders:]), summarize(records, slo=slo)
    print(f"{name:<34} {dec['itl_ms_median']:>9.0f} {dec['itl_ms_p99']:>9.0f} {dec['tpot_ms_mean']:>9.0f} "
          f"{longs['ttft_ms_median']:>10.0f} {every['goodput']:>8.3f} {every['request_throughput']:>8.3f}")
    return {"decoders": dec, "longs": longs, "all": every}


def decode_stall(engine: LLMEngine, decoders: list[list[int]], prompts: list[list[int]]) -> tuple[float, float]:
    """Median seconds of a decode step of `decoders` alone, and the median extra seconds of a step that also
    prefills one of `prompts`: what every running decoder waits, once per such prompt, when one engine does both."""
    ids = [engine.add_request(None, p, SamplingParams(max_tokens=500, ignore_eos=True)) for p in decoders]
    engine.step()  # the decoders' prompts
    plain, mixed = [], []
    for prompt in prompts:
        for _ in range(5):
            start = time.perf_counter()
            engine.step()
            plain.append(time.perf_counter() - start)
        engine.add_request(None, prompt, SamplingParams(max_tokens=1))
        start = time.perf_counter()
        engine.step()
        mixed.append(time.perf_counter() - start)
    for i in ids:
        engine.abort(i)
    step = statistics.median(plain)
    return step, statistics.median(mixed) - step


def gpu_inequality(name: str, config: ModelConfig, tokens: int) -> None:
    """(c) on GPUs, by formula: an H200's roofline prefill time (max of FLOPs / peak and bytes / bandwidth, bf16) of
    `tokens` prompt tokens, against the bf16 KV bytes of those tokens over each link."""
    costs = prefill_costs(config, tokens, dtype_bytes=2)
    prefill_s = max(total_flops(costs) / H200_FLOPS, total_bytes(costs) / H200_BYTES_S)
    kv = kv_cache_bytes(tokens, config.num_layers, config.num_kv_heads, config.head_dim, 2)
    print(f"{name}, {tokens} tokens: H200 roofline prefill {1e6 * prefill_s:,.1f} us "
          f"({1e9 * prefill_s / tokens:.2f} ns/token); KV {kv / 1e6:.2f} MB ({kv // tokens:,} bytes/token)")
    for link, bandwidth in LINKS.items():
        move = kv / bandwidth
        print(f"    {link:<32} {bandwidth / 1e9:>5.0f} GB/s: transfer {1e6 * move:>9,.1f} us;  prefill / transfer = "
              f"{prefill_s / move:>7.2f}  -> {'pays' if prefill_s > move else 'does not pay'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pd_disagg", description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 100, 256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--long-len", type=int, default=512)
    parser.add_argument("--short-len", type=int, default=64, help="(c) also weighs a prompt this short")
    parser.add_argument("--longs", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=8)
    parser.add_argument("--gap", type=float, default=2.5, help="seconds between long prompts' arrivals")
    parser.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0)
    args = parser.parse_args(argv)
    print(describe_machine().replace("Ran on", "Machine") + f"; load average {os.getloadavg()[0]:.2f} at the start")
    path = resolve_model()
    config = ModelConfig.from_dir(path)
    with PDPair(device="cpu", prefill_threads=1, decode_threads=1) as pair:
        sizes = [n for n in args.lengths for _ in range(args.repeats)]
        mixed = [32] * args.decoders + [args.long_len] * args.longs
        weighed = (args.short_len, args.long_len)  # (c): a stall per prompt length, `repeats` prompts each
        prompts = windows(corpus_ids(pair.tokenizer), sizes + mixed + [n for n in weighed for _ in range(args.repeats)])
        pulls = transfer_sizes(pair, prompts[:len(sizes)], args.lengths, args.repeats, config)
        work = mixed_workload(prompts[len(sizes):len(sizes) + len(mixed)], args.decoders, args.decode_tokens,
                              args.longs, args.long_tokens, 1.0, args.gap)
        slo = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}
        print(f"\n(b) {args.decoders} decoders (32-token prompts, {args.decode_tokens} tokens each) from t = 0, then "
              f"{args.longs} prompts of {args.long_len} tokens ({args.long_tokens} tokens each) every {args.gap} s "
              f"from t = 1 s; SLO TTFT <= {args.slo_ttft_ms:.0f} ms, TPOT <= {args.slo_tpot_ms:.0f} ms")
        print(f"{'':<34} {'decoder ITL ms':>19} {'TPOT ms':>9} {'long TTFT':>10} {'goodput':>8} {'req/s':>8}")
        print(f"{'':<34} {'median':>9} {'P99':>9} {'mean':>9} {'median ms':>10} {'req/s':>8} {'':>8}")
        pair.reset_prefix_cache()
        seen = len(pair.instance_stats()["decode"][0]["transfers"])
        split = run_mixed(pair, "split: prefill 1 + decode 1 thread", work, args.decoders, slo)
        loaded_pulls = [r.seconds for r in pair.instance_stats()["decode"][0]["transfers"][seen:]
                        if r.num_blocks == -(-args.long_len // 16)]
    results, stalls = {}, {}
    for threads in (2, 1):
        engine = LLMEngine(device="cpu", num_threads=threads)
        try:
            results[threads] = run_mixed(engine, f"one engine, {threads} thread{'s' * (threads > 1)}", work,
                                         args.decoders, slo)
            stalled = prompts[len(sizes) + len(mixed):]
            stalls[threads] = {n: decode_stall(engine, work[0][:args.decoders],
                                               stalled[i * args.repeats:(i + 1) * args.repeats])
                               for i, n in enumerate(weighed)}
        finally:
            engine.shutdown()
    print("\nEqual total threads (2 vs 1 + 1) is the fair comparison: the same two cores either way. The 1-thread "
          "engine\nhas half the compute of the pair; it shows what each instance alone would do with both phases.")
    for threads, result in results.items():
        one, two = result["decoders"], split["decoders"]
        print(f"split vs one engine with {threads} thread{'s' * (threads > 1)}: decoders' ITL P99 "
              f"{two['itl_ms_p99']:.0f} / {one['itl_ms_p99']:.0f} ms = {two['itl_ms_p99'] / one['itl_ms_p99']:.2f}x; "
              f"goodput {split['all']['goodput']:.3f} / {result['all']['goodput']:.3f} req/s; long prompts' TTFT "
              f"{split['longs']['ttft_ms_median'] / result['longs']['ttft_ms_median']:.2f}x")

    print("\n(c) Disaggregation pays when the interference it removes exceeds the transfer it adds, per prompt:")
    for tokens in weighed:
        pull = pulls.get(tokens)
        for threads, by_length in stalls.items():
            step, stall = by_length[tokens]
            line = (f"{tokens} tokens, one engine, {threads} thread{'s' * (threads > 1)}: a decode step of "
                    f"{args.decoders} takes {1e3 * step:.0f} ms; one with the prefill too takes {1e3 * stall:.0f} ms "
                    "more (the stall every decoder waits)")
            if pull is not None:
                line += (f"; the pull takes {1e3 * pull:.1f} ms (idle pair), stall / pull = {stall / pull:,.1f} "
                         f"(x {args.decoders} decoders stalled: {args.decoders * stall / pull:,.1f})")
            print(line)
    if loaded_pulls:
        print(f"pulls of the long prompts during the mixed run: median {1e3 * statistics.median(loaded_pulls):.1f} ms")
    print("\nOn GPUs, by formula (data-sheet bandwidths per direction and H200 peaks; the roofline prefill is a lower "
          "bound on the stall,\nreal prefills run below peak; transfer = bandwidth term only, no latency):")
    for tokens in (args.long_len, 8192):
        gpu_inequality("SmolLM2-135M", config, tokens)
        gpu_inequality("Llama-3-70B", LLAMA3_70B, tokens)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
