"""Chapter 7 — the process behind every rank but 0: it loads its shard of the model, then runs each step rank 0
plans.

Rank 0 (the process of the `LLM`) keeps the scheduler; a worker only follows. It stops on rank 0's word, when
rank 0's process dies (the kernel signals it), or when a collective fails because a peer is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback

import torch

from ..config import ModelConfig
from .config import ParallelConfig
from .pipeline import StepPlan, execute_plan
from .state import ParallelContext, init_parallel

REPORT = "report"  # rank 0 asks for every rank's communication counts and trace
STOP = None


def report(ctx: ParallelContext, trace: list) -> dict:
    """This rank's communication counts and trace events since its last report (then cleared)."""
    out = {"rank": ctx.rank, "world": dict(ctx.world.stats), "tp": dict(ctx.tp.stats) if ctx.tp else {},
           "trace": list(trace)}
    ctx.world.stats.clear()
    if ctx.tp:
        ctx.tp.stats.clear()
    trace.clear()
    return out


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to kill this process when its parent dies, so a crashed `LLM` leaves no worker behind."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before the request was in place
        os._exit(1)


def worker_main(rank: int, parent_pid: int, path, config: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype,
                device_type: str, load_format: str, port: int, threads: int, errors) -> None:
    """Rank `rank`'s life: join the groups, load the shard, allocate the KV cache rank 0 sizes, follow steps."""
    from ..kv_cache import KVCache
    from ..model import load_model

    die_with_parent(parent_pid)
    torch.set_num_threads(threads)
    device = torch.device(device_type if device_type == "cpu" else f"{device_type}:{rank}")
    try:
        ctx = init_parallel(parallel, rank, port, device)
        model = load_model(path, config, dtype, device, load_format, ctx=ctx)
        num_blocks, block_size, kv_cache_dtype = ctx.control.broadcast_object()
        kv_cache = KVCache.allocate(parallel.local_config(config, rank), num_blocks, block_size, dtype, device,
                                    kv_cache_dtype)
        trace = []
        while (message := ctx.control.broadcast_object()) is not STOP:
            if isinstance(message, StepPlan):
                execute_plan(model, kv_cache, ctx, message, trace if message.trace else None)
            elif message == REPORT:
                ctx.control.send_object(report(ctx, trace), 0)
    except BaseException:  # for rank 0 to name in its own error; the peers see this process's sockets close
        errors.put(f"rank {rank}: {traceback.format_exc(limit=4)}")
        os._exit(1)
