"""Chapter 4 — the scheduler decides, each step, which tokens of which sequences run: continuous batching with
chunked prefill.

Every step spends a budget of `max_num_batched_tokens`. Running sequences go first (one token each when
decoding, the next chunk of their prompt otherwise); whatever budget is left admits waiting requests,
oldest first, as long as a small watermark of blocks stays free for the running ones to grow into (the
siblings of an n > 1 request wait until the first has computed the shared prompt). A
finished sequence leaves at once and frees its blocks; when blocks run out anyway, the newest running
sequence is preempted (its blocks freed, to be recomputed later).

A decoding sequence with drafts (chapter 10's speculative decoding) runs its last token and its drafts in one
step, as many as the budget allows; drafts that do not fit are dropped.

A decode whose prompt another instance prefilled (chapter 9) is admitted like any other request, but instead
of running it waits in `loading` (WAITING_FOR_REMOTE_KVS) with its blocks allocated, until the engine has
installed the K/V it pulled; then it runs from its first token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus

WATERMARK = 0.01  # share of the pool kept free at admission, so a new request rarely evicts itself next step


@dataclass
class SchedulerOutput:
    """One step's work: each scheduled sequence with its number of new tokens, and KV block copies to make first."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[Sequence] = field(default_factory=list)  # just allocated: pull their prompts' K/V (chapter 9)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)


class Scheduler:
    """Waiting and running queues over a shared block pool."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.watermark_blocks = int(WATERMARK * block_manager.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []  # allocated, waiting for their K/V from a remote prefill
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self) -> SchedulerOutput:
        """Fill this step's token budget: running sequences first, then new ones."""
        out, budget = SchedulerOutput(), self.max_num_batched_tokens
        bm = self.block_manager
        for seq in list(self.running):  # oldest first, so the newest are the ones preempted
            if budget == 0:
                break
            if seq not in self.running:
                continue  # preempted below to make room for an older one
            n = min(seq.num_uncomputed_tokens + len(seq.draft_token_ids), budget)
            del seq.draft_token_ids[max(0, n - seq.num_uncomputed_tokens):]  # the drafts that fit run
            while not bm.can_grow(seq, seq.num_cached_tokens + n) and seq in self.running:
                self._preempt(self.running[-1])
            if seq in self.running:
                out.block_copies += bm.grow(seq, seq.num_cached_tokens + n)
                out.add(seq, n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.waits_for_leader(bm.block_size):
                break  # a sibling of an n > 1 request: next step its prompt blocks are in the cache
            if not bm.allocate(seq, reserve=self.watermark_blocks if self.running else 0):
                break
            self.waiting.popleft()
            if seq.remote_prefill is not None:  # its prompt's K/V come from the prefill instance
                seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
                self.loading.append(seq)
                out.kv_loads.append(seq)
                continue
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            out.block_copies += bm.grow(seq, seq.num_cached_tokens + n)
            out.add(seq, n)
            budget -= n
        return out

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and send it back to the front of the queue to be recomputed."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.draft_token_ids.clear()
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish_loading(self, seq: Sequence, installed: bool) -> None:
        """A remote prefill's K/V are installed in the sequence's blocks: it decodes from the next step on. Or the
        prefill instance no longer had them: the sequence goes back to the front of the queue to be computed here,
        as after a preemption."""
        self.loading.remove(seq)
        seq.remote_prefill = None
        if installed:
            seq.num_cached_tokens = len(seq.prompt_token_ids)
            self.block_manager.commit(seq)  # later requests with the same prefix find it here
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        else:
            self.block_manager.free(seq)
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str, free_blocks: bool = True) -> None:
        """Mark a sequence finished and release its blocks (unless they are held for another instance to pull)."""
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        for queue in (self.running, self.waiting, self.loading):
            if seq in queue:
                queue.remove(seq)
        if free_blocks:
            self.block_manager.free(seq)
