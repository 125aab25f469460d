"""What the HTTP front door costs: the server against `LLM.generate` on the same requests, in one run.

(a) saturation: the seeded chat workload (prompts 16-128 tokens, answers 64-256, ignore_eos), every
    request sent at once over streaming /v1/completions, against `LLM.generate` on the same token ids;
    output tokens per second of each. Target: the server reaches >= 0.9x the offline rate.
(b) low load: one request at a time; median TTFT seen by the HTTP client against the engine's own TTFT
    for the same prompt offline. Target: within 15 ms.

The server is `python -m minillm serve` in a child process; the client (minillm.bench) and the offline
engine run in this one. Both engines use the same number of PyTorch threads (default 1, leaving the other
core to the HTTP client and the server's event loop), and the variants alternate round by round.

    .venv/bin/python -m benchmarks.serving [--requests 32] [--rounds 3] [--threads 1] [--ttft-requests 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm import LLM, SamplingParams, threads
from minillm.bench import make_workload, run_http

OVERHEAD_TARGET = 0.9
TTFT_TARGET_MS = 15


class ServerProcess:
    """`python -m minillm serve` on 127.0.0.1 and a free port, stopped (SIGTERM, then kill) on exit."""

    def __init__(self, threads: int, *args: str, cwd: str | None = None):
        """`args` are more `serve` flags; `cwd` runs the `minillm` found there (another checkout) instead."""
        self.proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--port", "0", "--threads",
                                      str(threads), "--drain-seconds", "0", *args], stdout=subprocess.PIPE, text=True,
                                     cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True).start()
        try:  # the first line says where it listens; a server that never says so is stopped, not left behind
            line = lines.get(timeout=300)
            self.url = line.split(" at ")[1].split()[0]
        except (queue.Empty, IndexError):
            self.__exit__()
            raise RuntimeError(f"the server started by {' '.join(self.proc.args)} never said where it listens "
                               f"(exit code {self.proc.returncode})") from None

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def offline_rate(llm: LLM, work) -> float:
    """Output tokens per second of `LLM.generate` on the whole workload at once."""
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in work]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [m for _, m in work]
    return sum(m for _, m in work) / seconds


def http_rate(url: str, model: str, work) -> float:
    """Output tokens per second through the server, every request sent at once, streaming."""
    run = asyncio.run(run_http(url, model, work, [0.0] * len(work), ignore_eos=True))
    assert not run.errors, run.errors[:3]
    assert [r.output_tokens for r in run.records] == [m for _, m in work]
    return sum(r.output_tokens for r in run.records) / run.duration


def offline_ttft(llm: LLM, prompt: list[int]) -> float:
    out = llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    return out.metrics.first_token_time - out.metrics.arrival_time


def http_ttft(url: str, model: str, prompt: list[int]) -> float:
    run = asyncio.run(run_http(url, model, [(prompt, 2)], [0.0], ignore_eos=True))
    assert not run.errors, run.errors
    r = run.records[0]
    return r.first_token_time - r.arrival_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32, help="chat requests per saturation round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttft-requests", type=int, default=10, help="prompts timed one at a time")
    parser.add_argument("--threads", type=int, default=1, help="PyTorch threads of both engines")
    args = parser.parse_args()
    os.environ[threads.ENV] = str(args.threads)  # the offline engine sets it when built

    llm = LLM()
    tok = llm.get_tokenizer()
    work = make_workload("chat", args.requests, tok)
    with ServerProcess(args.threads) as server:
        model = "SmolLM2-135M-Instruct"
        print(f"offline engine and server: {llm.engine.device}, {llm.engine.dtype}, {args.threads} PyTorch "
              f"thread(s) each; {os.cpu_count()} CPUs; server at {server.url}")
        warm = make_workload("chat", 4, tok, seed=123)
        offline_rate(llm, warm), http_rate(server.url, model, warm)  # warm-up of both

        print(f"\n(a) saturation: {len(work)} chat requests at once, "
              f"{sum(m for _, m in work)} output tokens, prompts {sum(len(p) for p, _ in work)} tokens")
        ratios = []
        for r in range(args.rounds):
            first, second = ("offline", "http") if r % 2 == 0 else ("http", "offline")
            rates = {}
            for name in (first, second):
                rates[name] = offline_rate(llm, work) if name == "offline" else http_rate(server.url, model, work)
            ratios.append(rates["http"] / rates["offline"])
            print(f"  round {r + 1}: LLM.generate {rates['offline']:6.1f} tok/s   server (HTTP, streaming) "
                  f"{rates['http']:6.1f} tok/s   server / offline = {ratios[-1]:.3f}")
        ratio = statistics.median(ratios)
        print(f"  median server / offline = {ratio:.3f} (target >= {OVERHEAD_TARGET}): "
              f"{'met' if ratio >= OVERHEAD_TARGET else 'MISSED'}")

        prompts = [p for p, _ in make_workload("chat", args.ttft_requests, tok, seed=7)]
        print(f"\n(b) low load: {len(prompts)} prompts, one request at a time, TTFT")
        pairs = []
        for i, p in enumerate(prompts):
            order = (offline_ttft, http_ttft) if i % 2 == 0 else (http_ttft, offline_ttft)
            got = {f: f(llm, p) if f is offline_ttft else f(server.url, model, p) for f in order}
            pairs.append((got[offline_ttft] * 1000, got[http_ttft] * 1000))
        off, http = statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)
        gap = statistics.median(b - a for a, b in pairs)
        print(f"  median TTFT: offline {off:.1f} ms, through the server {http:.1f} ms; "
              f"median difference {gap:+.1f} ms (target <= {TTFT_TARGET_MS} ms): "
              f"{'met' if gap <= TTFT_TARGET_MS else 'MISSED'}")


if __name__ == "__main__":
    main()
