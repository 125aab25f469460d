"""What the benchmarks share: the option that sets the engine's PyTorch threads, and the header a kept result
carries (the day, the CPU, its vector instructions, its cores), so that a recorded figure can be read beside the
machine that printed it."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from minillm import threads
from minillm.workload import cpu_model


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """`--threads N`: the engine's PyTorch CPU threads, 1 unless told (0 keeps the engine's own default)."""
    parser.add_argument("--threads", type=int, default=1,
                        help="PyTorch CPU threads (default 1; 0 = the engine's default)")


def use_threads(args: argparse.Namespace) -> None:
    """Make engines built from now on use `args.threads` threads (the engine reads the variable when built)."""
    if args.threads:
        os.environ[threads.ENV] = str(args.threads)


def save_json(path: str | Path, **fields) -> None:
    """`fields` as JSON at `path`, after the day, the CPU's model, its widest vector instructions as PyTorch sees
    them (one model name can cover CPUs with and without AVX-512) and its core count."""
    record = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpus": os.cpu_count(), **fields}
    Path(path).write_text(json.dumps(record, indent=1) + "\n")
