"""llama.cpp's own server against minillm's, both serving the default model on the CPU, driven by the same client.

`llama-server` (built once from the llama.cpp sources inside the llama-cpp-python 0.3.36 sdist, at the lowest CPU
priority, and cached under minillm's cache directory: `benchmarks/llamacpp_build.py`) serves the default GGUF file;
`python -m minillm serve --quantization int4` serves the same weights (Q4_1 maps exactly onto its int4 format), and
`--float32` adds the float32 server as a third row. All run at once on 127.0.0.1 (the others idle while one is
timed), with the same thread count and as many parallel slots as the highest concurrency. Each measurement is one
`python -m minillm bench` run: the seeded chat workload (prompts 16-128 token ids, answers 64-256 tokens,
ignore_eos) streamed from /v1/completions at `--concurrency` requests in flight. Rounds alternate which server goes
first; the table gives each minillm figure's ratio to llama-server's in the same round. Every process started here
is stopped on exit.

    .venv/bin/python -m benchmarks.llamacpp_server [--rounds 2] [--concurrency 16 32] [--requests 64] [--threads 2]
        [--float32] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.llamacpp_build import LLAMA_CPP, build, started, tail
from benchmarks.record import save_json
from minillm.bench import load_tokenizer, make_workload
from minillm.ports import free_port
from minillm.weights import DEFAULT_MODEL, default_gguf_path

SLOT_CONTEXT = 512  # tokens per llama-server slot: the longest chat request is 128 prompt + 256 answer tokens
READY_TIMEOUT = 300.0  # seconds a server may take to load
FIGURES = {"output_throughput": "out tok/s", "ttft_ms_median": "TTFT P50 ms", "ttft_ms_p99": "TTFT P99 ms",
           "itl_ms_median": "ITL P50 ms", "tpot_ms_median": "TPOT P50 ms"}
LLAMA = "llama-server"


# --- the servers ----------------------------------------------------------------------------------------------

def llama_command(binary: Path, port: int, slots: int, threads: int) -> list[str]:
    """llama-server on the default GGUF under minillm's model name, `slots` sequences decoded together
    (continuous batching), `threads` for decode and prompt processing alike."""
    return [str(binary), "--model", str(default_gguf_path()), "--alias", DEFAULT_MODEL, "--host", "127.0.0.1",
            "--port", str(port), "--parallel", str(slots), "--cont-batching", "--ctx-size", str(slots * SLOT_CONTEXT),
            "--threads", str(threads), "--threads-batch", str(threads), "--no-webui"]


def minillm_command(slots: int, threads: int, quantization: str | None) -> list[str]:
    """`python -m minillm serve` on the CPU and a free port, at most `slots` sequences in a batch."""
    return [sys.executable, "-m", "minillm", "serve", "--host", "127.0.0.1", "--port", "0", "--device", "cpu",
            "--threads", str(threads), "--max-num-seqs", str(slots), "--drain-seconds", "0",
            *(["--quantization", quantization] if quantization else [])]


def wait_ready(proc: subprocess.Popen, log: Path, url: Callable[[], str | None], name: str) -> str:
    """Poll `url()` until it gives the server's API root; a RuntimeError if the process exits or time runs out."""
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode}:\n{tail(log)}")
        if found := url():
            return found
        time.sleep(0.25)
    raise RuntimeError(f"{name} was not ready after {READY_TIMEOUT:.0f} s:\n{tail(log)}")


def llama_url(port: int) -> Callable[[], str | None]:
    """llama-server is ready when /health answers 200 (503 while the model loads)."""
    def ready() -> str | None:
        try:
            ok = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return None
        return f"http://127.0.0.1:{port}/v1" if ok else None
    return ready


def minillm_url(log: Path) -> Callable[[], str | None]:
    """minillm's server is ready when it prints `minillm: serving NAME at URL`."""
    def ready() -> str | None:
        found = re.search(r"minillm: serving \S+ at (http://\S+/v1)", log.read_text(errors="replace"))
        return found and found.group(1)
    return ready


# --- one measurement: `python -m minillm bench` against one server --------------------------------------------

def bench(url: str, requests: int, concurrency: int, seed: int, folder: Path, timeout: float) -> dict:
    """The result `python -m minillm bench --save-result` writes for the chat workload at `concurrency`."""
    result = folder / f"bench-{time.monotonic_ns()}.json"
    log = folder / "bench.log"
    cmd = [sys.executable, "-m", "minillm", "bench", "--base-url", url, "--model", DEFAULT_MODEL, "--dataset", "chat",
           "--num-prompts", str(requests), "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(seed),
           "--percentiles", "50,99", "--timeout", str(timeout), "--no-progress", "--save-result", result.name,
           "--result-dir", str(folder)]
    with started(cmd, log) as proc:
        try:
            status = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the benchmark of {url} took more than {timeout:.0f} s") from None
    if status != 0:
        raise RuntimeError(f"python -m minillm bench --base-url {url} failed:\n{tail(log)}")
    out = json.loads(result.read_text())
    if out["failed"]:
        raise RuntimeError(f"{out['failed']} requests to {url} failed, e.g. {out['errors'][0]}")
    return out


# --- the comparison -------------------------------------------------------------------------------------------

def compare(args: argparse.Namespace, binary: Path, folder: Path) -> list[dict]:
    """Start every server, warm each up, then run the rounds; one record per measurement."""
    slots = max(args.concurrency)
    formats = {"minillm int4": "int4", **({"minillm float32": None} if args.float32 else {})}
    work = make_workload("chat", args.requests, load_tokenizer(), args.seed)  # what each bench run sends
    expected = (sum(len(p) for p, _ in work), sum(m for _, m in work))  # prompt and output tokens
    records, load = [], os.getloadavg()[0]  # other work on the machine slows whichever server it meets
    with contextlib.ExitStack() as stack:
        port = free_port()
        log = folder / "llama-server.log"
        procs = {LLAMA: (stack.enter_context(started(llama_command(binary, port, slots, args.threads), log)),
                         log, llama_url(port))}
        for name, quantization in formats.items():
            log = folder / f"{name.replace(' ', '-')}.log"
            procs[name] = (stack.enter_context(started(minillm_command(slots, args.threads, quantization), log)), log,
                           minillm_url(log))
        urls = {name: wait_ready(proc, log, url, name) for name, (proc, log, url) in procs.items()}
        print(f"servers: {', '.join(f'{n} at {u}' for n, u in urls.items())}; {args.threads} thread(s) and "
              f"{slots} slots each; {os.cpu_count()} CPUs, load average {load:.1f} before they started; "
              f"{args.requests} chat requests, {expected[1]} output tokens per measurement", flush=True)
        for url in urls.values():  # warm-up
            bench(url, min(4, args.requests), min(4, slots), args.seed + 1, folder, args.timeout)
        for r in range(args.rounds):
            order = list(urls) if r % 2 == 0 else list(urls)[::-1]
            for concurrency in args.concurrency:
                for name in order:
                    out = bench(urls[name], args.requests, concurrency, args.seed, folder, args.timeout)
                    got = (out["total_input_tokens"], out["total_output_tokens"])
                    if got != expected:
                        raise RuntimeError(f"{name} counted {got[0]} prompt and {got[1]} output tokens, expected "
                                           f"{expected[0]} and {expected[1]} (prompt changed or ignore_eos ignored?)")
                    records.append({"server": name, "round": r + 1, "concurrency": concurrency, **out})
    return records


def table(records: list[dict]) -> str:
    """One row per measurement; each minillm figure followed by its ratio to llama-server's in the same round."""
    base = {(x["round"], x["concurrency"]): x for x in records if x["server"] == LLAMA}
    lines = [f"{'server':<16} {'conc':>4} {'round':>5} " + " ".join(f"{h:>16}" for h in FIGURES.values())]
    for x in sorted(records, key=lambda x: (x["concurrency"], x["round"], x["server"] != LLAMA)):
        cells = []
        for key in FIGURES:
            cell = f"{x[key]:.1f}"
            if x["server"] != LLAMA:
                cell += f" ({x[key] / base[x['round'], x['concurrency']][key]:.2f}x)"
            cells.append(f"{cell:>16}")
        lines.append(f"{x['server']:<16} {x['concurrency']:>4} {x['round']:>5} " + " ".join(cells))
    for concurrency in sorted({x["concurrency"] for x in records}):
        for name in sorted({x["server"] for x in records} - {LLAMA}):
            ratios = [x["output_throughput"] / base[x["round"], concurrency]["output_throughput"]
                      for x in records if x["server"] == name and x["concurrency"] == concurrency]
            lines.append(f"concurrency {concurrency}: {name} / {LLAMA} output tok/s, median over rounds "
                         f"{statistics.median(ratios):.2f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llamacpp_server", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 32], help="requests in flight")
    parser.add_argument("--requests", type=int, default=64, help="chat requests per measurement")
    parser.add_argument("--threads", type=int, default=2, help="threads of each server")
    parser.add_argument("--float32", action="store_true", help="also serve minillm in float32")
    parser.add_argument("--seed", type=int, default=0, help="of the chat workload")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one measurement may take")
    parser.add_argument("--build-jobs", type=int, default=2, help="parallel compile jobs of the one-time build")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="save every measurement here")
    args = parser.parse_args(argv)
    for name in ("rounds", "requests", "threads", "build_jobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.concurrency) < 1:
        parser.error("--concurrency must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a plain kill still runs the cleanup below
    try:
        binary = build([LLAMA], LLAMA_CPP, args.build_jobs)[LLAMA]
    except RuntimeError as e:
        print(f"llama-server is not available: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="llamacpp-server-") as tmp:
        try:
            records = compare(args, binary, Path(tmp))
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    print(f"\n{LLAMA} (llama.cpp from {LLAMA_CPP.package} {LLAMA_CPP.version}) against minillm on "
          f"{default_gguf_path().name}; "
          "ratios are minillm / llama-server in the same round\n" + table(records))
    if args.json is not None:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        save_json(args.json, settings=settings, llama_server=str(binary), runs=records)
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
