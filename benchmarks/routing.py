"""Chapter 9 — which replica should serve a request: the routers compared on one multi-tenant workload, in one run.

Tenants each have a long system prompt that every request of their users starts with; users (each belonging to
one tenant) send short questions at Poisson arrival times over the chat endpoint, with the OpenAI `user` field.
Two replicas (`--replicas`) of the default model, one PyTorch thread each, serve the same requests under each router in turn,
each router on a fresh service (cold caches): round robin, Serve's power of two choices (`least_loaded`),
prefix affinity and session affinity. Each replica's KV pool holds one replica's share of the tenants' system
prompts (`--kv-fraction`, default 1 / replicas), the regime where routing decides what is cached: together the
replicas hold every prompt, one alone does not. Round robin (and any load-only router) keeps a copy of a prompt
on every replica it visits, so with tenants drawn at random each replica caches about its pool's share of all
the prompts; prefix affinity gives each replica its own share, which fits. In steady state that bounds the gain
at the number of replicas, 2x for two, and each tenant's first request misses under any router, so on a finite
run two replicas stay below 2x; round robin also computes each prompt once per replica where prefix affinity
computes it once. Per router: the prefix-cache hit rate over both replicas (`prefix_cache_hit_tokens /
prefix_cache_query_tokens` of each engine's stats, before and after the run), TTFT P50/P99 as the client saw
it, and the share of the requests each replica served (the `x-minillm-replica` header); then ratios against
round robin. Targets for prefix affinity: >= 2x round robin's hit rate, >= 1.5x lower TTFT P50, and no replica
above 70 % of the requests.

    .venv/bin/python -m benchmarks.routing [--replicas 2] [--requests 80] [--rate 0.6] [--tenants 10] [--routers ...]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm.bench import corpus_ids, first_model, run_http
from minillm.engine_args import EngineArgs
from minillm.metrics import poisson_arrivals, summarize
from minillm.service.ray_app import RayService
from minillm.service.routers import ROUTERS
from minillm.weights import resolve_model

HIT_RATE_TARGET, TTFT_TARGET, SHARE_LIMIT = 2.0, 1.5, 0.7
WARMUP_REQUESTS = 4
IN_FLIGHT_ROOM = 4  # requests whose own blocks (question, answer) each pool has room for beside the prefixes


def multi_tenant(tokenizer, requests: int, tenants: int, users: int, system_tokens: int,
                 question_tokens: tuple[int, int], max_tokens: int, seed: int = 0):
    """(chat messages, max_tokens) per request and the user sending it. Tenant t's system prompt is the t-th
    window of `system_tokens` tokens of the packaged text; user u belongs to tenant u % tenants; each request
    is a random user's question (a window of the text after the system prompts) after the tenant's prompt."""
    ids, rng = corpus_ids(tokenizer), random.Random(seed)
    if (tenants + 1) * system_tokens > len(ids):
        raise ValueError(f"{tenants} system prompts of {system_tokens} tokens do not fit in the text's {len(ids)}")
    systems = [tokenizer.decode(ids[t * system_tokens:(t + 1) * system_tokens]) for t in range(tenants)]
    rest = ids[tenants * system_tokens:]
    work, senders = [], []
    for _ in range(requests):
        user = rng.randrange(users)
        length = rng.randint(*question_tokens)
        start = rng.randrange(len(rest) - length)
        question = tokenizer.decode(rest[start:start + length])
        work.append(([{"role": "system", "content": systems[user % tenants]}, {"role": "user", "content": question}],
                     max_tokens))
        senders.append(f"user-{user}")
    return work, senders


def cache_counters(service: RayService) -> dict[str, tuple[int, int]]:
    """Each replica's (prefix-cache hit tokens, query tokens) so far."""
    return {s["replica_id"]: (s["prefix_cache_hit_tokens"], s["prefix_cache_query_tokens"])
            for s in service.replica_stats()}


def run_router(router: str, engine_args: EngineArgs, replicas: int, work, users, arrivals) -> dict:
    """One fresh service under `router`: a warm-up, then the workload; hit rate, TTFT and replica shares."""
    with RayService(engine_args, replicas=replicas, router=router) as service:
        url = f"{service.url}/v1"
        model = asyncio.run(first_model(url))
        warm = [([{"role": "user", "content": f"Warm-up {i}: say hello."}], 2) for i in range(WARMUP_REQUESTS)]
        asyncio.run(run_http(url, model, warm, [0.0] * len(warm), endpoint="chat", ignore_eos=True,
                             users=[f"warmup-{i}" for i in range(len(warm))]))
        before = cache_counters(service)
        run = asyncio.run(run_http(url, model, work, arrivals, endpoint="chat", ignore_eos=True, users=users))
        after = cache_counters(service)
    if run.errors:
        raise RuntimeError(f"{router}: {len(run.errors)} requests failed, e.g. {run.errors[0]}")
    hits = sum(after[r][0] - before.get(r, (0, 0))[0] for r in after)
    queries = sum(after[r][1] - before.get(r, (0, 0))[1] for r in after)
    summary = summarize(run.records, run.duration, percentiles=(50, 99))
    served = Counter(run.served_by)
    return {"hit_rate": hits / queries, "ttft_p50": summary["ttft_ms_median"], "ttft_p99": summary["ttft_ms_p99"],
            "shares": sorted((n / len(run.records) for n in served.values()), reverse=True),
            "replicas": len(served), "seconds": run.duration}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--rate", type=float, default=0.6, help="Poisson arrival rate, requests per second")
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--users", type=int, default=40)
    parser.add_argument("--system-tokens", type=int, default=400, help="tokens of text in each system prompt")
    parser.add_argument("--question-tokens", type=int, nargs=2, default=(16, 48), metavar=("MIN", "MAX"))
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens per request (ignore_eos)")
    parser.add_argument("--kv-fraction", type=float,
                        help="each replica's KV pool: this fraction of all system prompts' blocks (default: "
                             f"1 / replicas), plus room for {IN_FLIGHT_ROOM} requests' own blocks")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=list(ROUTERS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if "round_robin" not in args.routers:
        parser.error("round_robin is the baseline: include it")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model())
    work, users = multi_tenant(tokenizer, args.requests, args.tenants, args.users, args.system_tokens,
                               tuple(args.question_tokens), args.max_tokens, args.seed)
    arrivals = poisson_arrivals(args.rate, args.requests, args.seed)
    block_size = EngineArgs().block_size
    system_blocks = math.ceil((args.system_tokens + 8) / block_size)  # the chat template adds a few tokens
    in_flight = IN_FLIGHT_ROOM * math.ceil((args.question_tokens[1] + args.max_tokens + 16) / block_size)
    kv_fraction = args.kv_fraction or 1 / args.replicas
    kv_blocks = math.ceil(kv_fraction * args.tenants * system_blocks) + in_flight
    engine_args = EngineArgs(num_threads=1, num_kv_blocks=kv_blocks, max_num_seqs=args.max_num_seqs)
    print(f"{args.requests} chat requests at {args.rate:g}/s (Poisson) from {args.users} users of {args.tenants} "
          f"tenants; system prompts {args.system_tokens} tokens, questions {args.question_tokens[0]}-"
          f"{args.question_tokens[1]}, {args.max_tokens} output tokens each")
    print(f"{args.replicas} replicas of the default model, 1 PyTorch thread each, {kv_blocks} KV blocks of "
          f"{block_size} tokens each (~{kv_fraction:.2g} of the system prompts' {args.tenants * system_blocks} blocks + "
          f"{in_flight} for {IN_FLIGHT_ROOM} requests' own); {os.cpu_count()} CPUs\n")

    results = {}
    for router in args.routers:
        start = time.perf_counter()
        results[router] = r = run_router(router, engine_args, args.replicas, work, users, arrivals)
        shares = " / ".join(f"{s:.0%}" for s in r["shares"])
        print(f"{router:>13}: hit rate {r['hit_rate']:6.1%}  TTFT P50 {r['ttft_p50']:7.0f} ms  "
              f"P99 {r['ttft_p99']:7.0f} ms  requests per replica {shares}  "
              f"({time.perf_counter() - start:.0f} s)", flush=True)

    base = results["round_robin"]
    print(f"\nagainst round robin (hit rate: x higher, at most {args.replicas}x in steady state; TTFT: x lower)")
    for router, r in results.items():
        print(f"{router:>13}: hit rate {r['hit_rate'] / base['hit_rate']:5.2f}x  "
              f"TTFT P50 {base['ttft_p50'] / r['ttft_p50']:5.2f}x  P99 {base['ttft_p99'] / r['ttft_p99']:5.2f}x  "
              f"busiest replica {r['shares'][0]:.0%}")
    if "prefix" in results:
        p = results["prefix"]
        checks = [(p["hit_rate"] / base["hit_rate"] >= HIT_RATE_TARGET, f"hit rate >= {HIT_RATE_TARGET:g}x"),
                  (base["ttft_p50"] / p["ttft_p50"] >= TTFT_TARGET, f"TTFT P50 >= {TTFT_TARGET:g}x lower"),
                  (p["shares"][0] <= SHARE_LIMIT and p["replicas"] == args.replicas,
                   f"no replica above {SHARE_LIMIT:.0%}")]
        print("\nprefix affinity: " + ", ".join(f"{what} {'met' if ok else 'NOT met'}" for ok, what in checks))
        return 0 if all(ok for ok, _ in checks) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
