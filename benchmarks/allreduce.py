"""This machine's all-reduce: latency and bus bandwidth of gloo between processes on 127.0.0.1, by message size.

A decode step of tensor parallelism all-reduces two hidden-state vectors per layer (a few KB at batch 1): its
cost is latency, not bandwidth. Usage:

    .venv/bin/python -m benchmarks.allreduce [--ranks 2 3] [--repeats 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm.parallel.comm import run_group, time_all_reduce

SIZES = [4, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.allreduce", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    for ranks in args.ranks:
        rows = run_group(time_all_reduce, ranks, SIZES, args.repeats, timeout=600)[0]
        print(f"gloo all-reduce, {ranks} processes on 127.0.0.1 (1 thread each), median of {args.repeats}:")
        for r in rows:
            print(f"  {r['bytes']:>10,} bytes  {1e6 * r['seconds']:10.1f} us  bus {r['bus_gb_s']:6.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
