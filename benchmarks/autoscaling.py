"""Chapter 9 — Serve's autoscaler, live: one day of traffic compressed into minutes, under three replica policies.

The arrival rate follows a day: a trickle at night, a ramp through the morning to an afternoon peak that one
replica cannot keep up with, and back. Requests (short prompts from the packaged text, a fixed number of
output tokens) arrive by a Poisson process of that rate (thinning), the same arrivals for every policy. Each
policy runs on a fresh service of the default model (one PyTorch thread per replica, at most two replicas):

- scale to zero: `min_replicas` 0, so an idle service keeps no replica and a request after a quiet spell
  waits for a whole cold start;
- a floor of one: `min_replicas` 1, one replica always warm, a second added under load;
- fixed at the peak: two replicas all day, no autoscaling.

While the day runs, Serve's replica states are sampled twice a second. Per policy: replica-seconds (starting
or running: what one pays for), each scale-up's cold start as Serve saw it (a replica's first STARTING sample
to its RUNNING), and TTFT split by what the request found when it arrived: no replica running (it waits for a
cold start), one running and another starting (a scale-up under way), or no replica starting (warm). `--report
PATH` prints that summary again from a saved run. The day is compressed (by
`86400 / --day-s`) and Serve's delays with it; a cold start is not, so the compressed day exaggerates its
cost: read the waits in seconds, not as a share of the day. `--json` writes every figure and sample (chapter
9 reads benchmarks/results/autoscaling.json).

    .venv/bin/python -m benchmarks.autoscaling [--day-s 240] [--peak-rate 4] [--json PATH] [--report PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import os
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks.record import save_json
from minillm.bench import corpus_ids, first_model, run_http
from minillm.engine_args import EngineArgs
from minillm.service.ray_app import RayService
from minillm.weights import resolve_model

MAX_REPLICAS = 2
SAMPLE_S = 0.5  # how often Serve's replica states are read
KV_ROOM_REQUESTS = 32  # requests each replica's KV pool holds at once
POLICIES = {"scale to zero": {"min_replicas": 0}, "floor of 1": {"min_replicas": 1}, "fixed at 2": None}


def day_rate(t: np.ndarray, day_s: float, peak: float, night: float) -> np.ndarray:
    """Requests per second at `t` seconds into a day of `day_s`: `night` at 04:00, rising as the cube of a
    cosine to `night + peak` at 16:00."""
    diurnal = 0.5 - 0.5 * np.cos(2 * np.pi * (t / day_s - 4 / 24))
    return night + peak * diurnal ** 3


def day_arrivals(day_s: float, peak: float, night: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process with `day_rate`, by thinning one of the highest rate."""
    rng, top, t, times = random.Random(seed), night + peak, 0.0, []
    while (t := t + rng.expovariate(top)) < day_s:
        if rng.random() < day_rate(np.array(t), day_s, peak, night) / top:
            times.append(t)
    return times


def autoscaling(policy: dict) -> dict:
    """Serve's autoscaling fields for `policy`. Its defaults (30 s up, 600 s down, a 30 s look-back) shrunk by the
    day's compression would be shorter than its control loop, so these are picked for a day of minutes."""
    return {**policy, "max_replicas": MAX_REPLICAS, "target_ongoing_requests": 2, "upscale_delay_s": 2,
            "downscale_delay_s": 15, "look_back_period_s": 11}  # Serve wants more than its 10 s metrics interval


async def sample_states(service: RayService, samples: list, stop: asyncio.Event, start: float) -> None:
    """Append [seconds since `start`, replicas starting, replicas running] every SAMPLE_S until `stop` is set."""
    while not stop.is_set():
        states = await asyncio.to_thread(service.replica_states)
        samples.append([round(time.perf_counter() - start, 2), states.get("STARTING", 0), states.get("RUNNING", 0)])
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_S)
        except TimeoutError:
            pass


async def run_day(service: RayService, work, arrivals: list[float]) -> tuple:
    url = f"{service.url}/v1"
    model = await first_model(url)
    samples, stop = [], asyncio.Event()
    start = time.perf_counter()
    sampler = asyncio.create_task(sample_states(service, samples, stop, start))
    run = await run_http(url, model, work, arrivals, ignore_eos=True, timeout=300)
    stop.set()
    await sampler
    return run, samples, start


def cold_starts(samples: list) -> list[float]:
    """Seconds from each replica's first STARTING sample to the sample where the RUNNING count rose, from
    [time, starting, running] samples."""
    starts, pending, running = [], [], 0
    for t, starting, now_running in samples:
        while len(pending) < starting:
            pending.append(t)
        for _ in range(max(0, now_running - running)):
            if pending:
                starts.append(t - pending.pop(0))
        del pending[starting:]
        running = now_running
    return starts


FOUND = ("no replica running", "a scale-up under way", "warm")


def found_at(samples: list, t: float) -> str:
    """What a request arriving at `t` found, from the last [time, starting, running] sample at or before it."""
    _, starting, running = samples[max(0, bisect.bisect_right(samples, t, key=lambda s: s[0]) - 1)]
    return FOUND[0] if not running else FOUND[1] if starting else FOUND[2]


def run_policy(name: str, policy: dict | None, engine_args: EngineArgs, work, arrivals) -> dict:
    scaled = autoscaling(policy) if policy is not None else None
    replicas = MAX_REPLICAS if policy is None else max(1, policy["min_replicas"])
    with RayService(engine_args, replicas=replicas, autoscaling=scaled) as service:
        if policy is not None and policy["min_replicas"] == 0:  # begin the day as an idle service would
            while service.replica_states():
                time.sleep(SAMPLE_S)
        run, samples, start = asyncio.run(run_day(service, work, arrivals))
    if run.errors:
        raise RuntimeError(f"{name}: {len(run.errors)} requests failed, e.g. {run.errors[0]}")
    times, starting, running = np.array(samples).T
    replica_seconds = float(np.sum((starting + running)[:-1] * np.diff(times)))
    requests = sorted(({"arrival_s": r.arrival_time - start, "ttft_s": r.first_token_time - r.arrival_time}
                       for r in run.records), key=lambda q: q["arrival_s"])
    for q in requests:
        q["found"] = found_at(samples, q["arrival_s"])
    return {"policy": name, "autoscaling": scaled, "replica_seconds": replica_seconds, "seconds": float(times[-1]),
            "cold_starts_s": cold_starts(samples), "requests": requests, "samples": samples}


def describe(result: dict) -> str:
    ttft = {found: [q["ttft_s"] for q in result["requests"] if q["found"] == found] for found in FOUND}

    def stats(xs):
        return (f"{len(xs):4d} requests, TTFT P50 {np.median(xs):6.2f} s  P99 {np.percentile(xs, 99):6.2f} s  "
                f"max {max(xs):6.2f} s") if xs else "   0 requests"
    colds = result["cold_starts_s"]
    return (f"{result['policy']:>14}: {result['replica_seconds']:6.0f} replica-seconds over {result['seconds']:.0f} s; "
            f"{len(colds)} cold starts" + (f" of {min(colds):.1f}-{max(colds):.1f} s" if colds else "") +
            "".join(f"\n{'':16}{found + ':':21} {stats(ttft[found])}" for found in FOUND))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--day-s", type=float, default=240, help="seconds the day is compressed into")
    parser.add_argument("--peak-rate", type=float, default=4.0, help="requests/s added at the afternoon peak")
    parser.add_argument("--night-rate", type=float, default=1 / 20, help="requests/s at night")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (ignore_eos)")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every figure and sample here")
    parser.add_argument("--report", type=Path, help="print the summary of a run saved with --json, and stop")
    args = parser.parse_args()
    if args.report:
        saved = json.loads(args.report.read_text())
        print(f"{saved['date']}, {saved['cpu']}, {saved['cpus']} CPUs: a day in {saved['day_s']:g} s, "
              f"{saved['requests']} requests\n")
        print("\n".join(describe(result) for result in saved["results"]))
        return 0

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model())
    arrivals = day_arrivals(args.day_s, args.peak_rate, args.night_rate, args.seed)
    ids, rng = corpus_ids(tokenizer), random.Random(args.seed)
    starts = [rng.randrange(len(ids) - args.prompt_tokens) for _ in arrivals]
    work = [(tokenizer.decode(ids[s:s + args.prompt_tokens]), args.max_tokens) for s in starts]
    # A fixed KV pool (a scaled-to-zero service needs one to know its context length without a replica).
    block_size = EngineArgs().block_size
    kv_blocks = KV_ROOM_REQUESTS * math.ceil((args.prompt_tokens + args.max_tokens) / block_size)
    engine_args = EngineArgs(num_threads=1, num_kv_blocks=kv_blocks)
    print(f"a day in {args.day_s:g} s ({86400 / args.day_s:.0f}x compressed): {len(arrivals)} requests, "
          f"{args.night_rate:g}/s at night to {args.night_rate + args.peak_rate:g}/s at the peak; {args.prompt_tokens}-"
          f"token prompts, {args.max_tokens} output tokens; at most {MAX_REPLICAS} replicas of the default model, "
          f"1 PyTorch thread each; {os.cpu_count()} CPUs")
    print(f"autoscaling: {autoscaling({})}\n")
    results = []
    for name in args.policies:
        results.append(run_policy(name, POLICIES[name], engine_args, work, arrivals))
        print(describe(results[-1]), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        save_json(args.json, day_s=args.day_s, peak_rate=args.peak_rate, night_rate=args.night_rate,
                  prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, requests=len(arrivals),
                  results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
