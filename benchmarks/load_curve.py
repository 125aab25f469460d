"""Chapter 8 — the latency–throughput curve of `python -m minillm serve`: every offered load held long enough for
its queue to settle (or to show that it never does), then the same overload against a bounded queue (HTTP 429).

(a) the ceiling: `LLM.generate` on a batch of the workload at once, in this process, with the server's threads
    and batch cap; its request rate sets the offered loads.
(b) the sweep: one server (its default waiting cap, 256), Poisson arrivals at each fraction of that rate
    (`--loads`) for `--seconds` of arrivals each; every run's prompts start with a token of their own, so no run
    finds another's prompts cached. Per load: throughput, TTFT / TPOT / ITL percentiles, goodput under an SLO
    of three times the TTFT and TPOT the longest prompt sees alone, and the waiting queue sampled from
    `/metrics` twice a second.
(c) overload with a bounded queue: a second server with `--max-waiting-requests` (`--queue-cap`) at the highest
    load: requests refused with 429, and the latency and goodput of the rest, against (b)'s run at that load.

The workload is chapter 8's: `chat` prompts of 16-128 tokens with answers cut to an eighth (8-32 tokens), so a
2-core CPU sweeps it in a quarter of an hour. The server runs `--threads` PyTorch threads (default 1), leaving a
core to the client in this process. `--json` writes every figure and sample; chapter 8 reads
benchmarks/results/load_curve.json.

    .venv/bin/python -m benchmarks.load_curve [--seconds 90] [--loads 0.25 0.5 ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import save_json
from benchmarks.serving import ServerProcess
from minillm import LLM, SamplingParams, threads
from minillm.bench import first_model, make_workload, run_http
from minillm.metrics import poisson_arrivals, summarize
from minillm.workload import cpu_model

MAX_NUM_SEQS = 8  # chapter 8's batch cap on a CPU
ANSWER_DIVISOR = 8  # chapter 8's answers: an eighth of the chat workload's 64-256 tokens
KEEP = ("completed", "duration", "request_throughput", "output_throughput", "goodput", "ttft_ms_median",
        "ttft_ms_p99", "tpot_ms_median", "tpot_ms_p99", "itl_ms_median", "itl_ms_p99", "e2el_ms_median")


def workload(tokenizer, n: int, seed: int, run: int) -> list[tuple[list[int], int]]:
    """n chat requests whose prompts start with a token of run `run`'s own (a fresh prefix for the cache)."""
    return [([1000 + run] + p, max(m // ANSWER_DIVISOR, 2)) for p, m in make_workload("chat", n, tokenizer, seed)]


class QueueSampler:
    """Polls the server's `/metrics` every `period` s in a thread: [s since start, running, waiting, refused]."""

    def __init__(self, url: str, period: float = 0.5):
        self.url, self.period, self.samples = url.removesuffix("/v1") + "/metrics", period, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        start = time.perf_counter()
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                values = {}
                for family in text_string_to_metric_families(client.get(self.url).text):
                    for s in family.samples:
                        values[s.name] = values.get(s.name, 0.0) + s.value  # refusals summed over reasons
                self.samples.append([round(time.perf_counter() - start, 2), values["minillm:num_requests_running"],
                                     values["minillm:num_requests_waiting"],
                                     values.get("minillm:request_rejected_total", 0.0)])
                self._stop.wait(self.period)

    def __enter__(self) -> QueueSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def offered(url: str, model: str, work, rate: float, slo: dict[str, float], seed: int) -> dict:
    """One run at `rate` requests/s: the summary (the KEEP fields), refusals, and the queue samples."""
    with QueueSampler(url) as sampler:
        run = asyncio.run(run_http(url, model, work, poisson_arrivals(rate, len(work), seed), ignore_eos=True))
    refused = [e for e in run.errors if "429" in e]
    if len(refused) != len(run.errors):
        raise RuntimeError(f"requests failed other than by 429: {[e for e in run.errors if '429' not in e][:3]}")
    summary = summarize(run.records, run.duration, slo)
    refused_at_start = sampler.samples[0][3] if sampler.samples else 0.0
    queue = [[t, running, waiting, refusals - refused_at_start] for t, running, waiting, refusals in sampler.samples]
    return {"rate": rate, "requests": len(work), "refused": len(refused), **{k: summary[k] for k in KEEP},
            "queue": queue}


def warmed(url: str, tokenizer, run: int) -> str:
    """The served model's name, after a warm-up of 8 requests sent at once (prompts of run `run`)."""
    model = asyncio.run(first_model(url))
    asyncio.run(run_http(url, model, workload(tokenizer, 8, 99, run), [0.0] * 8, ignore_eos=True))
    return model


def at_load(url: str, model: str, tokenizer, rate: float, seconds: float, slo: dict[str, float], seed: int,
            run: int) -> dict:
    """`offered` at `rate` for `seconds` of arrivals (at least 8 requests), workload seed 10 + `seed`."""
    n = max(round(rate * seconds), 8)
    return offered(url, model, workload(tokenizer, n, 10 + seed, run), rate, slo, seed=seed)


def alone(url: str, model: str, prompt: list[int], tokens: int = 8) -> tuple[float, float]:
    """TTFT and TPOT (ms) of one request on the idle server."""
    run = asyncio.run(run_http(url, model, [(prompt, tokens)], [0.0], ignore_eos=True))
    assert not run.errors, run.errors
    r = run.records[0]
    return 1000 * (r.first_token_time - r.arrival_time), 1000 * (r.finished_time - r.first_token_time) / (tokens - 1)


def row(load: float, r: dict) -> str:
    return (f"{load:5.2f}x {r['rate']:6.2f} {r['requests']:5d} {r['refused']:5d} {r['output_throughput']:7.1f} "
            f"{r['ttft_ms_median']:8.0f} {r['ttft_ms_p99']:8.0f} {r['itl_ms_median']:7.0f} {r['itl_ms_p99']:7.0f} "
            f"{r['goodput']:7.2f} {max(w for _, _, w, _ in r['queue']) if r['queue'] else 0:6.0f}")


HEADER = (f"{'load':>6} {'req/s':>6} {'sent':>5} {'429':>5} {'tok/s':>7} {'TTFT p50':>8} {'TTFT p99':>8} "
          f"{'ITL p50':>7} {'ITL p99':>7} {'goodput':>7} {'queue':>6}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="PyTorch threads of the server and the ceiling")
    parser.add_argument("--seconds", type=float, default=90.0, help="seconds of arrivals at each load")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0],
                        help="offered loads, as fractions of the ceiling's request rate")
    parser.add_argument("--ceiling-requests", type=int, default=64)
    parser.add_argument("--queue-cap", type=int, default=MAX_NUM_SEQS,
                        help="--max-waiting-requests of the bounded server in (c)")
    parser.add_argument("--json", type=Path, help="write every figure and sample here")
    args = parser.parse_args()
    os.environ[threads.ENV] = str(args.threads)  # the offline engine reads it when built

    llm = LLM(max_num_seqs=MAX_NUM_SEQS)
    tokenizer = llm.get_tokenizer()
    batch = workload(tokenizer, args.ceiling_requests, seed=3, run=0)
    llm.generate([p for p, _ in batch[:4]], [SamplingParams(max_tokens=4)] * 4, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate([p for p, _ in batch], [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in batch],
                 use_tqdm=False)
    ceiling_s = time.perf_counter() - start
    ceiling = {"requests": len(batch), "seconds": ceiling_s, "request_rate": len(batch) / ceiling_s,
               "output_throughput": sum(m for _, m in batch) / ceiling_s}
    llm.engine.shutdown()
    del llm
    print(f"{cpu_model()}, {os.cpu_count()} CPUs; server and ceiling: {args.threads} PyTorch thread(s), "
          f"--max-num-seqs {MAX_NUM_SEQS}")
    print(f"(a) ceiling, LLM.generate on {len(batch)} requests at once: {ceiling['request_rate']:.2f} req/s, "
          f"{ceiling['output_throughput']:.1f} output tok/s")

    flags = ("--max-num-seqs", str(MAX_NUM_SEQS))
    sweep = []
    with ServerProcess(args.threads, *flags) as server:
        model = warmed(server.url, tokenizer, run=1)
        longest = max((p for p, _ in batch), key=len)[1:]  # the ceiling's longest prompt, with fresh first tokens
        times = [alone(server.url, model, [997 + k] + longest) for k in range(3)]
        ttft_alone, tpot_alone = (statistics.median(t[i] for t in times) for i in (0, 1))
        slo = {"ttft_ms": 3 * ttft_alone, "tpot_ms": 3 * tpot_alone}
        print(f"alone on the idle server (median of 3), the longest prompt ({len(longest) + 1} tokens): "
              f"TTFT {ttft_alone:.0f} ms, TPOT {tpot_alone:.0f} ms; SLO: TTFT <= {slo['ttft_ms']:.0f} ms, "
              f"TPOT <= {slo['tpot_ms']:.0f} ms")
        print(f"\n(b) the sweep, {args.seconds:g} s of Poisson arrivals per load\n{HEADER}")
        for i, load in enumerate(args.loads):
            result = at_load(server.url, model, tokenizer, load * ceiling["request_rate"], args.seconds, slo,
                             seed=i, run=2 + i)
            sweep.append({"load": load, **result})
            print(row(load, result), flush=True)
    top, last = args.loads[-1], len(args.loads) - 1
    with ServerProcess(args.threads, *flags, "--max-waiting-requests", str(args.queue_cap)) as server:
        model = warmed(server.url, tokenizer, run=98)
        bounded = {"load": top, "queue_cap": args.queue_cap,  # the last sweep run's requests, fresh prefixes
                   **at_load(server.url, model, tokenizer, top * ceiling["request_rate"], args.seconds, slo,
                             seed=last, run=99)}
    print(f"\n(c) {top:g}x the ceiling, waiting queue capped at {args.queue_cap} (429 beyond it) against (b)'s "
          f"uncapped run\n{HEADER}\n{row(top, sweep[-1])}   uncapped\n{row(top, bounded)}   capped")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        save_json(args.json, threads=args.threads, max_num_seqs=MAX_NUM_SEQS, seconds=args.seconds, ceiling=ceiling,
                  alone={"prompt_tokens": len(longest) + 1, "ttft_ms": ttft_alone, "tpot_ms": tpot_alone}, slo=slo,
                  sweep=sweep, bounded=bounded)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
