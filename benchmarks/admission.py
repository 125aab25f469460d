"""What one abusive client costs everyone else: a small probe request's latency alone and while an abusive request
is in the server, on the server before admission control and on this one, in one run.

The abuses (each a single HTTP request):
  stops at the limit   16 stop strings of 256 characters, n = 16, 8 tokens (this server's defaults allow it)
  200,000 stops        200,000 five-character stop strings, n = 4, 8 tokens
  4 MB prompt          one prompt of 4,000,000 characters
  maximal batch        a body just under the 4 MiB body limit of one-character prompts (about 1,000,000)
The probe: `GET /health` and a 4-token greedy completion, sent together 0.3 s after the abuse; each is timed
alone too.

"Before" is another checkout of the server (`--before`, default the commit before admission control), run from
a temporary `git worktree`; "after" is this tree. Both run `python -m minillm serve` on 127.0.0.1 with the same
PyTorch threads, one at a time, and stop at the end.

    .venv/bin/python -m benchmarks.admission [--before REV] [--threads 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import save_json
from benchmarks.serving import ServerProcess

BEFORE = "a97433e"  # the server of chapter 8 before admission control
ROOT = Path(__file__).resolve().parents[1]
PROBE = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
LEAD = 0.3  # seconds between sending the abuse and the probe


def abuses() -> dict[str, bytes]:
    """The abusive request bodies (JSON), by name."""
    batch = ["a"] * (((4 << 20) - 512) // 5)  # '"a", ' is 5 bytes: the body stays inside the 4 MiB limit
    bodies = {
        "stops at the limit": {"prompt": "Once upon a time", "n": 16, "max_tokens": 8, "ignore_eos": True,
                               "temperature": 1.0, "stop": [f"{i:03d}" + "z" * 253 for i in range(16)]},
        "200,000 stops": {"prompt": "Once upon a time", "n": 4, "max_tokens": 8, "ignore_eos": True,
                          "temperature": 1.0, "stop": [f"{i:05d}" for i in range(100_000)] * 2},
        "4 MB prompt": {"prompt": "lorem ipsum " * 333_333 + "abcd", "max_tokens": 1},
        "maximal batch": {"prompt": batch, "max_tokens": 1},
    }
    return {name: json.dumps(body, separators=(", ", ": ")).encode() for name, body in bodies.items()}


def timed(send) -> tuple[float, int]:
    start = time.perf_counter()
    status = send()
    return time.perf_counter() - start, status


def probe(client: httpx.Client, base: str) -> tuple[float, float]:
    """Seconds for /health and for the probe completion, sent at the same moment (both must succeed)."""
    def health() -> float:
        seconds, status = timed(lambda: client.get(base + "/health").status_code)
        assert status == 200, status
        return seconds

    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(health)
        completion, status = timed(lambda: client.post(base + "/v1/completions", json=PROBE).status_code)
        assert status == 200, status
        return waiting.result(), completion


def under_abuse(client: httpx.Client, base: str, body: bytes) -> tuple[float, float, float, int]:
    """(health s, probe s, abuse s, abuse status) with the abuse sent `LEAD` seconds before the probe."""
    with ThreadPoolExecutor(1) as pool:
        abuse = pool.submit(timed, lambda: client.post(base + "/v1/completions", content=body,
                                                       headers={"content-type": "application/json"}).status_code)
        time.sleep(LEAD)
        health, completion = probe(client, base)
        return (health, completion, *abuse.result())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default=BEFORE, help="git revision of the server before admission control")
    parser.add_argument("--threads", type=int, default=1, help="PyTorch threads of each server")
    parser.add_argument("--rounds", type=int, default=2, help="repeats of each measurement")
    parser.add_argument("--save", default=None, metavar="PATH", help="also write the medians as JSON (for the book)")
    args = parser.parse_args()
    bodies = abuses()
    worktree = Path(tempfile.mkdtemp(prefix="minillm-before-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(worktree), args.before],
                   check=True, capture_output=True)
    try:
        runs = {"before": str(worktree), "after": None}
        results: dict[str, dict[str, list]] = {name: {} for name in runs}
        print(f"{args.threads} PyTorch thread(s) per server, {os.cpu_count()} CPUs; before = {args.before}, "
              f"after = this tree; probe sent {LEAD} s after the abuse; {args.rounds} rounds")
        for name, cwd in runs.items():  # one server at a time, so the other never takes a core
            with ServerProcess(args.threads, cwd=cwd) as server, httpx.Client(timeout=600) as client:
                base = server.url.removesuffix("/v1")
                probe(client, base)  # warm-up
                for _ in range(args.rounds):
                    results[name].setdefault("alone", []).append((*probe(client, base), 0.0, 0))
                    for abuse, body in bodies.items():
                        results[name].setdefault(abuse, []).append(under_abuse(client, base, body))
        print(f"\n{'':20} {'server':7} {'abuse answer':>13} {'abuse s':>8} {'/health s':>10} {'probe s':>8}")
        table = []
        for abuse in ["alone", *bodies]:
            for name in runs:
                rows = results[name][abuse]
                med = [statistics.median(r[i] for r in rows) for i in range(3)]
                status = "/".join(sorted({str(r[3]) for r in rows})) if abuse != "alone" else "-"
                print(f"{abuse:20} {name:7} {status:>13} {med[2]:8.2f} {med[0]:10.3f} {med[1]:8.3f}   "
                      f"(probe per round: {', '.join(f'{r[1]:.3f}' for r in rows)})")
                table.append({"abuse": abuse, "server": name, "abuse_status": status, "abuse_s": med[2],
                              "health_s": med[0], "probe_s": med[1], "probe_s_rounds": [r[1] for r in rows]})
        if args.save:
            save_json(args.save, before=args.before, threads=args.threads, rounds=args.rounds, results=table)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], capture_output=True)


if __name__ == "__main__":
    main()
