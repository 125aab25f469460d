"""Chapter 7 — sequence-parallel attention for long prompts: ring attention.

Each of P ranks holds a contiguous slice of the sequence: its queries, keys and values. In P steps every rank
attends from its queries to the key/value block it holds, then passes that block to the next rank and receives
one from the previous, so every query meets every key once while no rank ever holds more than two blocks. The
partial results are merged with chapter 5's online softmax (`kernels.online_softmax`): the same arithmetic that
lets FlashAttention visit keys tile by tile lets a ring visit them rank by rank. Communication per step is one
block of K and V, sent while the block in hand is computed on, so the transfer hides behind the compute whenever
attending to a block takes longer than sending it.
"""

from __future__ import annotations

import time

import torch

from ..kernels.online_softmax import merge_partials, partial_attention
from .comm import Comm


def split_sequence(length: int, world_size: int) -> list[tuple[int, int]]:
    """(start, end) of each rank's slice of a `length`-token sequence: contiguous, sizes differing by at most 1."""
    if length < world_size:
        raise ValueError(f"a sequence of {length} tokens cannot give each of {world_size} ranks a token")
    base, extra = divmod(length, world_size)
    bounds, start = [], 0
    for r in range(world_size):
        end = start + base + (r < extra)
        bounds.append((start, end))
        start = end
    return bounds


def ring_attention(comm: Comm, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, total: int,
                   causal: bool = True, scale: float | None = None, steps: list[dict] | None = None) -> torch.Tensor:
    """This rank's attention output `[n, heads, d]` for its slice (tokens `start .. start + n - 1` of `total`)
    of queries q `[n, heads, d]` and keys/values k, v `[n, kv_heads, d]`, attending to the whole sequence.

    Blocks travel padded to the longest slice, with their start and length in a small header, so ranks may hold
    slices of different lengths (`split_sequence`). Equals attention over the whole sequence on one device.
    Each step starts passing its block on before computing on it, so the transfer overlaps the compute. `steps`,
    when given, receives a record per ring step: whose block was in hand, the seconds spent computing on it and
    then waiting for the next one (the communication the compute did not hide), and the bytes passed.
    """
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads evenly")
    scale = d ** -0.5 if scale is None else scale
    longest = -(-total // comm.world_size)
    block = torch.zeros(2, longest, kv_heads, d, dtype=k.dtype)
    block[0, :n], block[1, :n] = k, v
    header = torch.tensor([start, n])
    positions = torch.arange(start, start + n)
    o = torch.zeros(heads, n, d)
    lse = torch.full((heads, n), float("-inf"))
    nxt, prev = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    for step in range(comm.world_size):
        began, last = time.perf_counter(), step == comm.world_size - 1
        if not last:  # start passing the block on (and taking the previous rank's) before computing on it
            next_block = comm.start_send_recv(block, torch.empty_like(block), nxt, prev, tag=0)
            next_header = comm.start_send_recv(header, torch.empty_like(header), nxt, prev, tag=1)
        kv_start, kv_len = header.tolist()
        keys = torch.arange(kv_start, kv_start + kv_len)
        mask = (keys[None, :] <= positions[:, None]) if causal else None
        for h in range(heads):
            g = h // (heads // kv_heads)
            o_b, lse_b = partial_attention(q[:, h], block[0, :kv_len, g], block[1, :kv_len, g], scale, mask)
            o[h], lse[h] = merge_partials(o[h], lse[h], o_b, lse_b)
        computed, sent = time.perf_counter(), 0 if last else block.nbytes + header.nbytes
        if not last:  # what the compute did not hide is waited for here
            block, header = next_block(), next_header()
        if steps is not None:
            steps.append({"rank": comm.rank, "step": step, "kv_start": kv_start, "kv_len": kv_len,
                          "compute_s": computed - began, "wait_s": time.perf_counter() - computed, "bytes": sent})
    return o.transpose(0, 1).to(q.dtype)


def ring_attention_rank(comm: Comm, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        causal: bool = True) -> tuple[torch.Tensor, list[dict]]:
    """This rank's part of ring attention when every rank is handed the whole q, k, v (a demonstration: a real
    caller holds only its slice): the output for its slice of the sequence, and its per-step records."""
    start, end = split_sequence(q.shape[0], comm.world_size)[comm.rank]
    steps: list[dict] = []
    out = ring_attention(comm, q[start:end], k[start:end], v[start:end], start, q.shape[0], causal, steps=steps)
    return out, steps
