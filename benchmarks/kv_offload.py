"""The KV offload tier on the default model: reloading an evicted block against recomputing it (chapter 10).

(a) Per block: the tier's reload (a slot's CRC-32 checked, its bytes copied into the pool) and store, timed on a pool
and tier of the engine's layout, and the engine's prefill of a prompt, per block of it. (b) A conversation that
returns after other traffic evicted its blocks from a small pool: time to first token of its second turn on two
engines, one with the tier and one without, alternating, over a few rounds (outputs asserted equal). (c) The
break-even in chapter 3's style: reloading beats recomputing when bytes per block / tier bandwidth < FLOPs per block
/ prefill FLOP/s, with this machine's measurements, then by formula for a GPU (data-sheet figures).

The engines run as `python -m minillm` runs them, OpenMP's waiting threads asleep (`OMP_WAIT_POLICY=PASSIVE`; with
spinning threads on a busy machine, a block's copy waited milliseconds for its second thread). Run it on an
otherwise idle machine:

    .venv/bin/python -m benchmarks.kv_offload [--threads 2] [--rounds 5] [--prompt-tokens 512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

if "torch" not in sys.modules:  # as `python -m minillm` runs the engine: OpenMP's waiting threads sleep
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402 (after the policy)

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pd_disagg import H200_BYTES_S, H200_FLOPS, LINKS  # noqa: E402
from minillm import LLM, SamplingParams  # noqa: E402
from minillm.bench import corpus_ids  # noqa: E402
from minillm.kv_cache import LLAMA3_70B, kv_block_bytes  # noqa: E402
from minillm.kv_offload import time_tier  # noqa: E402
from minillm.roofline import prefill_costs, total_bytes, total_flops  # noqa: E402
from minillm.workload import describe_machine  # noqa: E402

NVME_BYTES_S = 7e9  # data sheet: a PCIe 4.0 NVMe SSD's sequential read, not measured


def prefill_seconds(llm: LLM, prompt: list[int], repeats: int) -> float:
    """Median seconds from arrival to first token of `prompt`, nothing cached."""
    times = []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        out = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        times.append(out.metrics.first_token_time - out.metrics.arrival_time)
    return statistics.median(times)


def conversation_round(llm: LLM, turn1: list[dict], follow_up: str, evictors: list[list[int]],
                       reply_tokens: int) -> dict:
    """A conversation's first turn, other prompts that evict its blocks, then its second turn: that turn's TTFT,
    its tokens, and the changes of the prefix-cache and tier counters over it."""
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=reply_tokens, ignore_eos=True)
    reply = llm.chat(turn1, params, use_tqdm=False)[0].outputs[0].text
    llm.generate(evictors, SamplingParams(max_tokens=1), use_tqdm=False)
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": follow_up}]
    before = llm.stats()
    out = llm.chat(turn2, SamplingParams(max_tokens=8), use_tqdm=False)[0]
    after = llm.stats()
    delta = {k: after[k] - before[k] for k in ("prefix_cache_hit_tokens", "kv_offload_blocks_loaded")}
    return {"ttft": out.metrics.first_token_time - out.metrics.arrival_time, "tokens": out.outputs[0].token_ids,
            "prompt_tokens": len(out.prompt_token_ids), **delta}


def break_even(bytes_per_block: float, bandwidth: float, flops_per_block: float, flops_s: float) -> str:
    """The inequality with numbers: reload time against recompute time, and who wins by how much."""
    reload, recompute = bytes_per_block / bandwidth, flops_per_block / flops_s
    verdict = "reload wins" if reload < recompute else "recompute wins"
    return (f"{bytes_per_block:,.0f} B / {bandwidth / 1e9:,.2f} GB/s = {1e3 * reload:,.3f} ms  vs  "
            f"{flops_per_block / 1e9:,.3f} GFLOP / {flops_s / 1e9:,.1f} GFLOP/s = {1e3 * recompute:,.3f} ms  -> "
            f"{verdict} ({max(reload, recompute) / min(reload, recompute):,.1f}x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_offload", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of (b), each engine once per round")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="the conversation's first message, in tokens")
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--num-kv-blocks", type=int, default=64, help="the small device pool of (b)")
    parser.add_argument("--tier-gib", type=float, default=1.0, help="kv_offloading_size of (b)")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    common = dict(num_threads=args.threads, num_kv_blocks=args.num_kv_blocks)
    plain = LLM(**common)
    tiered = LLM(**common, kv_offloading_size=args.tier_gib)
    print(describe_machine().replace("Ran on", "Machine") + f"; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; "
          f"load average {load:.2f} at the start")
    config, block = plain.engine.config, plain.stats()["block_size"]
    tier = tiered.engine.kv_offload
    where = tier.path.parent if tier.path else "memory"
    print(f"pool {args.num_kv_blocks} blocks of {block} tokens; tier: {tier.backend} ({where}), {tier.num_slots} slots "
          f"of {tier.slot_bytes:,} bytes ({args.tier_gib:g} GiB)")

    # (a) per block
    per_block = kv_block_bytes(config, block, torch.float32)
    measured = time_tier(config, block, args.num_kv_blocks, tier.backend)
    ids = corpus_ids(plain.get_tokenizer())
    prompt = ids[:args.prompt_tokens]
    prefill_s = prefill_seconds(plain, prompt, repeats=5)
    blocks = args.prompt_tokens / block
    prefill_flops = total_flops(prefill_costs(config, args.prompt_tokens, dtype_bytes=4))
    flops_s, flops_per_block = prefill_flops / prefill_s, prefill_flops / blocks
    bandwidth = per_block / measured["load_s"]
    print(f"\n(a) one block = {block} tokens x {config.num_layers} layers x 2 x {config.num_kv_heads} KV heads x "
          f"{config.head_dim} x 4 bytes = {per_block:,} bytes (float32); medians")
    print(f"    reload from the tier (CRC-32 checked, copied into the pool): {1e3 * measured['load_s']:8.3f} "
          f"ms/block = {bandwidth / 1e9:.2f} GB/s")
    print(f"    store into the tier (at eviction):                          {1e3 * measured['store_s']:8.3f} ms/block")
    print(f"    the tier's slots read raw (a memcpy of the whole tier):     {measured['read_bytes_s'] / 1e9:8.2f} "
          "GB/s  (a file just written: its pages are in the page cache)")
    print(f"    recompute: prefill of {args.prompt_tokens} tokens {1e3 * prefill_s:.0f} ms = "
          f"{1e3 * prefill_s / blocks:8.3f} ms/block; {prefill_flops / 1e9:.1f} GFLOP (roofline count) -> "
          f"{flops_s / 1e9:.1f} GFLOP/s")
    print(f"    recompute / reload = {prefill_s / blocks / measured['load_s']:.0f}x per block")

    # (b) a returning conversation
    turns = []
    for r in range(args.rounds):  # windows of the packaged text, shifted each round, none sharing a prefix
        start = 400 * r % (len(ids) - args.prompt_tokens - 2100)
        text = plain.get_tokenizer().decode(ids[start:start + args.prompt_tokens])
        turn1 = [{"role": "user", "content": f"Read this and summarize it.\n\n{text}"}]
        evictors = [ids[start + args.prompt_tokens + 100 + 500 * i:][:480] for i in range(3)]
        turns.append((turn1, "Now say it again in one sentence.", evictors))
    ttft = {"without the tier": [], "with the tier": []}
    for r, (turn1, follow_up, evictors) in enumerate(turns):
        order = [("without the tier", plain), ("with the tier", tiered)][::1 if r % 2 == 0 else -1]
        results = {name: conversation_round(llm, turn1, follow_up, evictors, args.reply_tokens) for name, llm in order}
        without, reloaded = results["without the tier"], results["with the tier"]
        assert without["tokens"] == reloaded["tokens"], f"round {r}: the tier changed the greedy output"
        assert without["prefix_cache_hit_tokens"] == 0, f"round {r}: the conversation's blocks were not all evicted"
        assert reloaded["prefix_cache_hit_tokens"] == block * reloaded["kv_offload_blocks_loaded"] > 0
        for name in ttft:
            ttft[name].append(results[name]["ttft"])
    plain_ms, tier_ms = (1e3 * statistics.median(ttft[k]) for k in ("without the tier", "with the tier"))
    print(f"\n(b) a conversation returns after 3 other prompts evicted its blocks ({args.num_kv_blocks}-block pool): "
          f"its second turn has {reloaded['prompt_tokens']} prompt tokens, {reloaded['kv_offload_blocks_loaded']} "
          f"blocks reloaded ({reloaded['prefix_cache_hit_tokens']} tokens not recomputed; last round); "
          f"{args.rounds} rounds, alternating")
    for name, times in ttft.items():
        print(f"    TTFT {name:<17} median {1e3 * statistics.median(times):8.1f} ms   "
              f"(rounds: {', '.join(f'{1e3 * t:.0f}' for t in times)})")
    print(f"    without / with = {plain_ms / tier_ms:.2f}x; greedy outputs identical in every round")

    # (c) the break-even
    print("\n(c) reloading a block beats recomputing it when bytes_per_block / tier_bandwidth < flops_per_block / "
          "prefill_flops")
    print(f"    this machine (measured): {break_even(per_block, bandwidth, flops_per_block, flops_s)}")
    print(f"    break-even tier bandwidth here: {per_block * flops_s / flops_per_block / 1e6:,.1f} MB/s "
          f"(a slower tier loses to recomputing)")
    print(f"    by formula on a GPU (data sheets; bf16; a {args.prompt_tokens}-token prompt recomputed at the H200's "
          "roofline, the fastest it can run, so where reloading wins here it wins on the GPU too):")
    media = {"pinned host memory, PCIe 5.0 x16": LINKS["PCIe 5.0 x16"], "NVMe SSD": NVME_BYTES_S}
    for name, model in (("SmolLM2-135M", config), ("Llama-3-70B", LLAMA3_70B)):
        costs = prefill_costs(model, args.prompt_tokens, dtype_bytes=2)
        seconds = max(total_flops(costs) / H200_FLOPS, total_bytes(costs) / H200_BYTES_S)
        gpu_flops_s = total_flops(costs) / seconds
        per_block_bf16 = kv_block_bytes(model, block, torch.bfloat16)
        for medium, rate in media.items():
            print(f"    {name}, {medium} ({rate / 1e9:.0f} GB/s): "
                  f"{break_even(per_block_bf16, rate, total_flops(costs) / blocks, gpu_flops_s)}")
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    tiered.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
