"""PyTorch threads on a shared CPU: offline throughput with one thread, all cores but one, and all cores, with
and without a busy neighbour process, in one run.

Each configuration runs in a process of its own (OpenMP reads its settings when it starts): the chat and rag
workloads of `benchmarks/throughput.py` through `LLM.generate`, after a short warm-up. The neighbour is a
second process spinning on one core, as an HTTP front end, a notebook or a compiler would. Configurations
alternate within each round; the table gives the median over rounds and the slowest round.

    .venv/bin/python -m benchmarks.threads [--requests 16] [--rounds 2] [--workloads chat rag]

`benchmarks/results/threads.txt` holds the run that chose the command line's default (`minillm.threads`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm import threads

ROOT = Path(__file__).resolve().parents[1]


def child(workload: str, requests: int) -> None:
    """Run one workload in this process and print its output tokens per second as JSON."""
    import torch

    from minillm import LLM
    from minillm.bench import make_workload, run_minillm

    llm = LLM()
    tok = llm.get_tokenizer()
    run_minillm(llm, make_workload("chat", 4, tok, seed=123))  # warm-up
    result = run_minillm(llm, make_workload(workload, requests, tok))
    print(json.dumps({"tok_s": result["output_tokens"] / result["seconds"], "threads": torch.get_num_threads()}))


@contextlib.contextmanager
def neighbour(busy: bool):
    """A process spinning on one core for the duration (or nothing); always stopped on the way out."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def run(config: dict[str, str], workload: str, requests: int, busy: bool) -> float:
    env = {**os.environ, **config, "PYTHONPATH": str(ROOT)}
    with neighbour(busy):
        out = subprocess.run([sys.executable, "-m", "benchmarks.threads", "--child", workload,
                              "--requests", str(requests)], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=1800, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["tok_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.threads", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", default=["chat", "rag"], choices=["chat", "rag"])
    parser.add_argument("--child", choices=["chat", "rag"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.requests)
        return 0

    cores = threads.available_cores()
    counts = sorted({1, max(1, cores - 1), cores})
    configs = {f"{n} thread{'s' * (n > 1)}": {threads.ENV: str(n)} for n in counts}
    if cores > 1:
        configs[f"{cores} threads, passive wait"] = {threads.ENV: str(cores), "OMP_WAIT_POLICY": "PASSIVE"}
    print(f"{cores} cores available; {args.requests} requests per run, {args.rounds} rounds; "
          f"default: {threads.default_num_threads()} thread(s), "
          f"{'every core (waiting threads sleep)' if threads.passive_wait() else 'all cores but one'}; "
          "output tok/s, median (slowest round)")
    results: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for workload in args.workloads:
            for busy in (False, True):
                for name, config in configs.items():
                    results.setdefault((workload, busy, name), []).append(run(config, workload, args.requests, busy))
    header = "".join(f"{name:>28}" for name in configs)
    print(f"{'workload':<22}{header}")
    for workload in args.workloads:
        for busy in (False, True):
            cells = "".join(f"{statistics.median(r):>19.1f} ({min(r):6.1f})"
                            for r in (results[(workload, busy, name)] for name in configs))
            print(f"{workload + (', busy neighbour' if busy else ''):<22}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
