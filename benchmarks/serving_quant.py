"""The int4 engine served: `python -m minillm serve --quantization int4` against the float32 server, in one run.

Both servers run at once on 127.0.0.1 (one idles while the other is timed), with the same PyTorch thread count,
and the rounds alternate which goes first. Each round sends the seeded chat workload (prompts 16-128 tokens,
answers 64-256, ignore_eos) at `--concurrency` requests in flight through `minillm.bench.run_http` (the official
`openai` client, streaming /v1/completions), as `python -m minillm bench` does, and reads the output throughput
and TTFT P50. Greedy answers of the two servers are also compared on a few prompts: int4 changes some tokens,
so this prints how many of them agree rather than asserting equality.

    .venv/bin/python -m benchmarks.serving_quant [--requests 32] [--concurrency 16 32] [--rounds 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import ServerProcess
from minillm.bench import load_tokenizer, make_workload, run_http
from minillm.metrics import summarize
from minillm.weights import DEFAULT_MODEL

FORMATS = {"float32": (), "int4": ("--quantization", "int4")}


def rate(url: str, work, concurrency: int) -> tuple[float, float]:
    """(output tokens/s, TTFT P50 ms) of the workload through one server."""
    run = asyncio.run(run_http(url, DEFAULT_MODEL, work, [0.0] * len(work), max_concurrency=concurrency,
                               ignore_eos=True))
    assert not run.errors, run.errors[:3]
    summary = summarize(run.records, run.duration)
    return summary["output_throughput"], summary["ttft_ms_median"]


def greedy(url: str, prompts: list[list[int]], max_tokens: int = 32) -> list[str]:
    body = {"model": DEFAULT_MODEL, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0}
    choices = httpx.post(url + "/completions", json=body, timeout=300).raise_for_status().json()["choices"]
    return [c["text"] for c in sorted(choices, key=lambda c: c["index"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="PyTorch threads of each server")
    args = parser.parse_args()
    tok = load_tokenizer()
    work = make_workload("chat", args.requests, tok)
    servers = {name: ServerProcess(args.threads, *flags) for name, flags in FORMATS.items()}
    try:
        print(f"servers: {', '.join(f'{n} at {s.url}' for n, s in servers.items())}; {args.threads} PyTorch "
              f"thread(s) each; {os.cpu_count()} CPUs; {len(work)} chat requests, "
              f"{sum(m for _, m in work)} output tokens per round")
        warm = make_workload("chat", 4, tok, seed=123)
        for s in servers.values():
            rate(s.url, warm, 4)
        prompts = [p for p, _ in make_workload("chat", 8, tok, seed=5)]
        texts = {n: greedy(s.url, prompts) for n, s in servers.items()}
        same = sum(a == b for a, b in zip(texts["float32"], texts["int4"]))
        print(f"greedy answers (32 tokens) identical in {same} of {len(prompts)} prompts")
        for concurrency in args.concurrency:
            got: dict[str, list[tuple[float, float]]] = {n: [] for n in servers}
            for r in range(args.rounds):
                order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                for name in order:
                    got[name].append(rate(servers[name].url, work, concurrency))
            line = []
            for name, values in got.items():
                tput = statistics.median(v[0] for v in values)
                ttft = statistics.median(v[1] for v in values)
                line.append(f"{name} {tput:6.1f} tok/s (rounds: {', '.join(f'{v[0]:.1f}' for v in values)}), "
                            f"TTFT P50 {ttft:6.0f} ms")
            ratios = [b[0] / a[0] for a, b in zip(got["float32"], got["int4"])]
            print(f"concurrency {concurrency}: " + "; ".join(line)
                  + f"; int4 / float32 per round: {', '.join(f'{x:.2f}' for x in ratios)}")
    finally:
        for s in servers.values():
            s.__exit__()


if __name__ == "__main__":
    main()
