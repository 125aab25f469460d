"""Chapter 7 — one engine step on one rank of a parallel layout: the step's micro-batches flow through the
pipeline stages.

Stage s takes micro-batch j's hidden states from stage s - 1, runs its layers (sharded over its tensor-parallel
group, which all-reduces inside), and sends the result on to stage s + 1 while it starts on micro-batch j + 1.
The last stage turns hidden states into logits and sends them to rank 0, which samples. With p stages and m
micro-batches each stage idles for p - 1 of the m + p - 1 slots of a step: the pipeline bubble (GPipe).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..attention import MicroBatch
from .state import ParallelContext


@dataclass
class StepPlan:
    """What rank 0 sends every rank for one step: its micro-batches, and KV blocks to copy first."""

    micro_batches: list[MicroBatch]
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    trace: bool = False  # record when each micro-batch ran on each rank (`TraceEvent`s)


@dataclass
class TraceEvent:
    """Micro-batch `micro_batch` ran on `rank` (stage `stage`) from `start` to `end` (`time.perf_counter`, which
    is the system's monotonic clock, common to the processes of one machine); `waited` seconds before it, for
    the previous stage's activations."""

    rank: int
    stage: int
    micro_batch: int
    start: float
    end: float
    waited: float


@torch.inference_mode()
def execute_plan(model, kv_cache, ctx: ParallelContext, plan: StepPlan,
                 trace: list[TraceEvent] | None = None) -> list[torch.Tensor] | None:
    """Run this rank's part of the step; rank 0 returns each micro-batch's logits, the other ranks None."""
    kv_cache.copy_blocks(plan.block_copies)
    world, hidden, dtype = ctx.world, model.config.hidden_size, next(model.parameters()).dtype
    sends, logits = [], []
    last_rank = (ctx.pp_size - 1) * ctx.tp_size  # tensor-parallel rank 0 of the last stage: it has the logits
    for j, mb in enumerate(plan.micro_batches):
        wait_start = time.perf_counter()
        if ctx.is_first_stage:
            x = model.embed_tokens(mb.input_ids)
        else:
            x = world.recv(torch.empty(len(mb.input_ids), hidden, dtype=dtype), ctx.stage_peer(ctx.pp_rank - 1))
        start = time.perf_counter()
        x = model.run_layers(x, mb.positions, kv_cache, mb.meta)
        if not ctx.is_last_stage:
            sends.append(world.send(x, ctx.stage_peer(ctx.pp_rank + 1)))
        else:
            out = model.final_logits(x, mb.meta, mb.logits_indices)
            if out is not None and ctx.rank != 0 and mb.num_logits:
                sends.append(world.send(out.contiguous(), 0))
            elif out is not None:
                logits.append(out)
        if trace is not None:
            trace.append(TraceEvent(ctx.rank, ctx.pp_rank, j, start, time.perf_counter(), start - wait_start))
    if ctx.rank == 0 and not ctx.is_last_stage:
        vocab = model.config.vocab_size
        logits = [world.recv(torch.empty(mb.num_logits, vocab, dtype=dtype), last_rank) if mb.num_logits
                  else torch.empty(0, vocab, dtype=dtype) for mb in plan.micro_batches]
    for work in sends:
        work.wait()
    return logits if ctx.rank == 0 else None
