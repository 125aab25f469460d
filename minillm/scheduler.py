"""Decides, each step, which sequences run: new prompts (prefill) first, otherwise one token for every running one."""

from __future__ import annotations

from collections import deque

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


class Scheduler:
    """Waiting and running queues over a shared block pool; a finished sequence leaves and frees its blocks at once."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences to run this step and whether it is a prefill step."""
        batch, num_tokens = [], 0
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            new_tokens = seq.num_tokens - seq.num_cached_tokens
            if batch and num_tokens + new_tokens > self.max_num_batched_tokens:
                break  # a prompt longer than the budget still runs, alone
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            batch.append(self.waiting.popleft())
            num_tokens += new_tokens
        if batch:
            self.running.extend(batch)
            return batch, True
        for seq in list(self.running):  # oldest first, so the newest are the ones preempted
            while seq in self.running and not self.block_manager.can_allocate(seq):
                self._preempt(self.running[-1])
            if seq in self.running:
                self.block_manager.allocate(seq)
        return list(self.running), False

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and send it back to the front of the queue to be recomputed."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark a sequence finished and release its blocks."""
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
