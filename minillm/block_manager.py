"""Hands out fixed-size KV-cache blocks to sequences and takes them back."""

from __future__ import annotations

from collections import deque

from .sequence import Sequence


class BlockManager:
    """A free list of physical block ids; each sequence holds a block table covering its tokens."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether the sequence's current tokens (all of them) fit in the free blocks."""
        return self.blocks_needed(seq.num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Grow the sequence's block table to cover all its tokens."""
        need = self.blocks_needed(seq.num_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise RuntimeError(f"need {need} KV blocks, {self.num_free_blocks} free")
        seq.block_table.extend(self.free_blocks.popleft() for _ in range(need))

    def can_append(self, seq: Sequence) -> bool:
        """Whether one more token fits: either room in the last block or one free block."""
        return seq.num_tokens <= len(seq.block_table) * self.block_size or self.num_free_blocks > 0

    def free(self, seq: Sequence) -> None:
        """Return all of the sequence's blocks to the free list."""
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []
        seq.num_cached_tokens = 0
