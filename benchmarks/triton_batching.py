"""Request-level against continuous batching, in one run: the same closed-loop workload through Triton Inference
Server's dynamic batcher (minillm's engine behind PyTriton, `minillm.service.triton_model`) and through minillm's
own scheduler (`AsyncLLM`), alternating round by round on one engine.

`--clients` threads each send requests of the seeded chat workload (prompts 16-128 tokens, answers 64-256, greedy,
ignore_eos) one after another. Triton groups the requests waiting in its queue (up to `--max-queue-delay-ms`) and
runs each group to the end of its longest answer; minillm admits a request at the next step and retires each one
as it finishes. Triton answers without streaming, so its TTFT is the whole latency and its TPOT that latency over
the answer's tokens; minillm's are read from the stream.

    python -m benchmarks.triton_batching [--requests 32] [--clients 8] [--rounds 2] [--threads 1]

Needs `pip install minillm[triton]` (nvidia-pytriton); the result goes to `benchmarks/results/triton_batching.json`,
Triton's own log to `triton_batching.log` in the temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import add_threads_option, save_json, use_threads
from minillm import LLM, SamplingParams
from minillm.bench import make_workload
from minillm.serving.async_llm import AsyncLLM
from minillm.service.triton_model import TritonBatching, serve_triton, triton_client, triton_generate

ROOT = Path(__file__).resolve().parents[1]
Send = Callable[[list[int], int], tuple[float, float, int]]  # (prompt, max_tokens) -> (ttft s, latency s, tokens)


def closed_loop(make_send: Callable[[], AbstractContextManager[Send]], work, clients: int) -> dict[str, float]:
    """`clients` threads, each with its own `make_send()`, sending `work` one request after another; the
    throughput and P99 latencies of the whole run."""
    pending: queue.Queue = queue.Queue()
    for item in work:
        pending.put(item)
    records: list[tuple[float, float, int]] = []

    def client() -> None:
        with make_send() as send:
            while True:
                try:
                    prompt, max_tokens = pending.get_nowait()
                except queue.Empty:
                    return
                records.append(send(prompt, max_tokens))

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(client) for _ in range(clients)]:
            f.result()
    seconds = time.perf_counter() - start
    if sum(n for *_, n in records) != sum(m for _, m in work):
        raise RuntimeError("a request stopped before its max_tokens")
    ttft = [t for t, _, _ in records]
    tpot = [(lat - t) / (n - 1) if t < lat and n > 1 else lat / n for t, lat, n in records]
    return {"output_tokens_per_s": sum(n for *_, n in records) / seconds, "seconds": seconds,
            "ttft_ms_p99": 1000 * float(np.percentile(ttft, 99)), "tpot_ms_p99": 1000 * float(np.percentile(tpot, 99))}


def triton_sender(url: str, prompt_width: int) -> Callable[[], AbstractContextManager[Send]]:
    """Each client thread gets its own Triton client; no streaming, so TTFT is the full latency."""

    @contextmanager
    def make() -> Iterator[Send]:
        with triton_client(url) as client:
            def send(prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
                start = time.perf_counter()
                n = len(triton_generate(client, prompt, max_tokens, prompt_width))
                latency = time.perf_counter() - start
                return latency, latency, n

            yield send

    return make


class ContinuousBatching:
    """`AsyncLLM` on an event loop of its own thread, so that client threads can stream from it."""

    def __init__(self, llm: LLM):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = AsyncLLM(llm.engine)
        asyncio.run_coroutine_threadsafe(self.engine.start(), self.loop).result()

    async def _stream(self, prompt: list[int], max_tokens: int, request_id: str) -> tuple[float, float, int]:
        start, first, n = time.perf_counter(), None, 0
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        async for out in self.engine.generate(prompt, params, request_id):
            n = len(out.outputs[0].token_ids)
            if first is None and n:
                first = time.perf_counter() - start
        return first, time.perf_counter() - start, n

    def sender(self) -> AbstractContextManager[Send]:
        def send(prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
            coro = self._stream(prompt, max_tokens, uuid.uuid4().hex)
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

        return nullcontext(send)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.engine.stop(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path or name (default: minillm's default model)")
    parser.add_argument("--requests", type=int, default=32, help="requests per round and variant (default 32)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent client threads (default 8)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; the variants alternate within each")
    parser.add_argument("--max-queue-delay-ms", type=float, default=10.0, help="Triton's batching wait (default 10)")
    parser.add_argument("--save", default=str(ROOT / "benchmarks/results/triton_batching.json"),
                        help="where to write the JSON result")
    add_threads_option(parser)
    args = parser.parse_args(argv)
    use_threads(args)
    llm = LLM(args.model) if args.model else LLM()
    work = make_workload("chat", args.requests, llm.get_tokenizer())
    batching = TritonBatching(max_batch_size=args.clients, max_queue_delay_ms=args.max_queue_delay_ms,
                              preferred_batch_sizes=(args.clients,), prompt_width=max(len(p) for p, _ in work))
    results: dict[str, list[dict[str, float]]] = {"triton (request-level)": [], "minillm (continuous)": []}
    log = Path(tempfile.gettempdir()) / "triton_batching.log"
    with serve_triton(llm, batching, ignore_eos=True, log_file=log) as server:
        make_triton = triton_sender(server.url, batching.prompt_width)
        closed_loop(make_triton, work[:2], 2)  # warm-up
        for r in range(args.rounds):
            before = server.batch_sizes.copy()
            run = closed_loop(make_triton, work, args.clients)
            formed = server.batch_sizes - before
            run["requests_per_batch"] = sum(k * v for k, v in formed.items()) / sum(formed.values())
            results["triton (request-level)"].append(run)
            continuous = ContinuousBatching(llm)
            try:
                results["minillm (continuous)"].append(closed_loop(continuous.sender, work, args.clients))
            finally:
                continuous.close()
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    table = {name: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
             for name, runs in results.items()}
    requests_per_batch = table["triton (request-level)"]["requests_per_batch"]
    print(f"{args.requests} chat requests, {args.clients} clients, median of {args.rounds} rounds "
          f"(Triton does not stream: its TTFT is the full latency; {requests_per_batch:.1f} requests per batch)")
    print(f"{'':24} {'tok/s':>8} {'TTFT P99 ms':>12} {'TPOT P99 ms':>12}")
    for name, row in table.items():
        print(f"{name:24} {row['output_tokens_per_s']:8.1f} {row['ttft_ms_p99']:12.0f} {row['tpot_ms_p99']:12.1f}")
    save_json(args.save, requests=args.requests, clients=args.clients, rounds=args.rounds, threads=args.threads,
              max_queue_delay_ms=args.max_queue_delay_ms, results=table, rounds_detail=results)
    llm.shutdown()


if __name__ == "__main__":
    main()
