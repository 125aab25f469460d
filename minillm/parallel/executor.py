"""Chapter 7 — rank 0's side of a parallel layout (vLLM's multiprocessing executor): it starts the other ranks'
processes, holds rank 0's shard itself, and runs each step by sending its plan to every rank and taking its
part."""

from __future__ import annotations

import os
import threading
import weakref

import torch
import torch.multiprocessing as mp

from ..config import ModelConfig
from ..ports import free_port
from ..threads import engine_threads
from .config import ParallelConfig
from .pipeline import StepPlan, TraceEvent, execute_plan
from .state import init_parallel
from .worker import REPORT, STOP, report, worker_main


class MultiprocExecutor:
    """Ranks 1 .. N-1 as processes of their own; rank 0 in this one. `model` is rank 0's part of the model."""

    def __init__(self, path, config: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype,
                 device: torch.device, load_format: str = "auto", total_threads: int | None = None):
        from ..model import load_model

        if device.type == "cuda" and torch.cuda.device_count() < parallel.world_size:
            raise ValueError(f"{parallel.world_size} ranks need {parallel.world_size} GPUs; "
                             f"this machine has {torch.cuda.device_count()}")
        self.parallel, self.kv_cache, self.trace = parallel, None, []
        self.tracing = False  # when set, every rank records when each micro-batch ran (see `collect`)
        self.num_micro_batches = parallel.pipeline_parallel_size  # one per stage keeps every stage busy
        spawn = mp.get_context("spawn")
        self._errors, port = spawn.SimpleQueue(), free_port()
        threads = max(1, engine_threads(total_threads) // parallel.world_size)  # the ranks share the cores
        self._procs = [spawn.Process(target=worker_main, daemon=True,
                                     args=(rank, os.getpid(), path, config, parallel, dtype, device.type, load_format,
                                           port, threads, self._errors))
                       for rank in range(1, parallel.world_size)]
        for p in self._procs:
            p.start()
        self._stopper = weakref.finalize(self, stop_processes, self._procs)  # also at interpreter exit
        try:
            self.ctx = init_parallel(parallel, 0, port, device)
            self.model = load_model(path, config, dtype, device, load_format, ctx=self.ctx)
        except BaseException as e:
            self.shutdown()
            raise self._failure(e) from None

    def _failure(self, error: BaseException) -> BaseException:
        """A worker's own error when one reported it: a peer's failure surfaces here as a broken connection (a
        RuntimeError); any other error is this rank's own, and stands."""
        if isinstance(error, RuntimeError) and not self._errors.empty():
            return RuntimeError(f"a parallel worker failed: {self._errors.get()}")
        return error

    def _send(self, message) -> None:
        if not self._stopper.alive:
            raise RuntimeError("this parallel executor has been shut down")
        if lost := next((p for p in self._procs if not p.is_alive()), None):
            # a rank that died between steps: gloo may notice only at its timeout (minutes), so check first
            rank = self._procs.index(lost) + 1
            self.shutdown()
            raise self._failure(RuntimeError(f"parallel worker rank {rank} exited (code {lost.exitcode})"))
        try:
            self.ctx.control.broadcast_object(message)
        except RuntimeError as e:
            self.shutdown()
            raise self._failure(e) from None

    def start(self, kv_cache, num_blocks: int, block_size: int, kv_cache_dtype: str) -> None:
        """Every rank allocates a KV cache of `num_blocks` for its layers and heads; `kv_cache` is rank 0's."""
        self.kv_cache = kv_cache
        self._send((num_blocks, block_size, kv_cache_dtype))

    def execute(self, plan: StepPlan) -> list[torch.Tensor]:
        """Run one step on every rank; the logits of each micro-batch."""
        plan.trace = self.tracing
        self._send(plan)
        try:
            return execute_plan(self.model, self.kv_cache, self.ctx, plan, self.trace if plan.trace else None)
        except RuntimeError as e:
            self.shutdown()
            raise self._failure(e) from None

    def collect(self) -> list[dict]:
        """Every rank's communication counts (`OpStats` per collective) and trace events since the last call."""
        self._send(REPORT)
        reports = [report(self.ctx, self.trace)]
        reports += [self.ctx.control.recv_object(rank) for rank in range(1, self.parallel.world_size)]
        return reports

    def shutdown(self) -> None:
        """Tell the workers to stop and wait for them, killing any that cannot hear it (one stuck in an exchange
        an error cut short): idempotent."""
        told = False
        if self._stopper.alive and getattr(self, "ctx", None) is not None and all(p.is_alive() for p in self._procs):
            stop = threading.Thread(target=self._say_stop, daemon=True)
            stop.start()
            stop.join(timeout=10)
            told = not stop.is_alive()
        self._stopper.detach()
        stop_processes(self._procs, grace=10.0 if told else 0.0)

    def _say_stop(self) -> None:
        try:
            self.ctx.control.broadcast_object(STOP)
        except RuntimeError:
            pass  # a worker is already gone: the rest are stopped by `stop_processes`


def stop_processes(procs, grace: float = 0.0) -> None:
    """Wait up to `grace` seconds for each process to exit, then kill the rest."""
    for p in procs:
        p.join(timeout=grace)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()

