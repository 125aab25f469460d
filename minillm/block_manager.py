"""Chapter 4 — the block manager, which hands out fixed-size KV-cache blocks to sequences, shares full blocks
between equal prefixes and takes them back.

Each physical block has a reference count. A block whose tokens are all computed gets a chained hash
(hash of the previous block's hash and its own tokens), so a later request whose prompt starts with the
same tokens reuses it instead of recomputing (prefix caching). A freed block keeps its hash and contents
until the free list hands it out again, so a finished request's prefix stays reusable for a while.

The hash is SHA-256, as in vLLM: with Python's `hash()` one tenant could craft a prompt whose blocks
collide with another tenant's and be served their keys and values.

Chapter 10 gives evicted blocks a second life: with an offload tier (`kv_offload.py`), a cached block handed out
for new contents is first copied there, and a prompt whose blocks miss the pool but are found there gets fresh
blocks with those contents reloaded, counted as cached exactly like the pool's own hits.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .sequence import Sequence

if TYPE_CHECKING:
    from .kv_offload import KVOffloadTier


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


def block_hash(prev_hash: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """Chained SHA-256: equal hashes mean equal tokens in this block and in every block before it."""
    return hashlib.sha256((prev_hash or b"") + array("q", token_ids).tobytes()).digest()


class BlockManager:
    """Free list, per-sequence block tables, reference counts and the prefix-cache index."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 offload: KVOffloadTier | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.offload = offload  # chapter 10: where evicted cached blocks go, and come back from
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # least recently freed first
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.hit_tokens = self.query_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_free(self, keep: Collection[bytes] = ()) -> int:
        """The least recently freed block, for new contents; cached contents it held go to the offload tier (where
        they may not displace the blocks of `keep`, about to be reloaded)."""
        block_id, _ = self.free_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]  # its old contents are about to be overwritten
            if self.offload is not None:
                self.offload.store(block.hash, block_id, keep)  # still intact: no step runs before this returns
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def _prefix_hits(self, seq: Sequence) -> tuple[list[int], list[tuple[bytes, tuple[int, ...]]]]:
        """Ids of cached blocks holding the sequence's leading full blocks, in order; then (hash, tokens) of the
        full blocks right after them that the offload tier holds (chapter 10).

        A request that asks for its prompt's log-probs computes every prompt position, so it takes no hits.
        """
        hits, offloaded, prev = [], [], None
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return hits, offloaded
        tokens = seq.token_ids
        for i in range(len(tokens) // self.block_size):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            prev = block_hash(prev, chunk)
            block_id = self.cached.get(prev)
            if not offloaded and block_id is not None and self.blocks[block_id].token_ids == chunk:
                hits.append(block_id)
            elif self.offload is not None and self.offload.lookup(prev):
                offloaded.append((prev, chunk))
            else:
                break
        return hits, offloaded

    def allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        """Give a new (or preempted) sequence blocks for all its tokens, reusing cached prefix blocks (and reloading
        offloaded ones into fresh blocks).

        Returns False, changing nothing, unless `reserve` free blocks would still be left afterwards.
        """
        assert not seq.block_table
        hits, offloaded = self._prefix_hits(seq)
        fresh = self.blocks_needed(seq.num_tokens) - len(hits)  # offloaded blocks come back into fresh ones
        reclaimed = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # cached but on the free list
        # a full hit recomputes the last token inside the last hit block: a copy if someone else holds it
        copy = int(bool(hits) and not offloaded and len(hits) * self.block_size >= seq.num_tokens
                   and self.blocks[hits[-1]].ref_count > 0)
        if fresh + reclaimed + copy + reserve > self.num_free_blocks:
            return False
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_ids[block_id]
            block.ref_count += 1
        keep = {h for h, _ in offloaded}
        seq.block_table = hits + [self._take_free(keep) for _ in range(fresh)]
        seq.block_hashes = [self.blocks[b].hash for b in hits] + self._reload(seq.block_table[len(hits):], offloaded)
        # at least the last token must run through the model to produce the next token's logits
        seq.num_cached_tokens = min(len(seq.block_hashes) * self.block_size, seq.num_tokens - 1)
        self.hit_tokens += seq.num_cached_tokens
        self.query_tokens += seq.num_tokens
        return True

    def _reload(self, block_ids: list[int], offloaded: list[tuple[bytes, tuple[int, ...]]]) -> list[bytes]:
        """Load offloaded blocks into the fresh `block_ids`, in order, and index them as cached; stop at the first
        the tier no longer has or refuses (that block and the rest are computed). Returns the hashes loaded."""
        loaded = []
        for block_id, (h, chunk) in zip(block_ids, offloaded):
            if not self.offload.load(h, block_id):
                break
            block = self.blocks[block_id]
            block.hash, block.token_ids = h, chunk
            self.cached.setdefault(h, block_id)
            loaded.append(h)
        return loaded

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the sequence's table can cover `num_tokens` tokens (and a copy-on-write) from free blocks."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table) + (1 if self._needs_copy(seq) else 0)
        return need <= self.num_free_blocks

    def _needs_copy(self, seq: Sequence) -> bool:
        """Whether the next token to compute lands in a block another sequence also holds."""
        i = seq.num_cached_tokens // self.block_size
        return i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1

    def grow(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Cover `num_tokens` tokens; copy-on-write a shared block about to be written.

        Returns the (source, destination) block copies the KV cache must make before the step runs.
        """
        copies = []
        if self._needs_copy(seq):
            i = seq.num_cached_tokens // self.block_size
            src = seq.block_table[i]
            dst = self._take_free()
            self.blocks[src].ref_count -= 1
            seq.block_table[i] = dst
            del seq.block_hashes[i:]
            copies.append((src, dst))
        while len(seq.block_table) < self.blocks_needed(num_tokens):
            seq.block_table.append(self._take_free())
        return copies

    def commit(self, seq: Sequence, tokens: list[int] | None = None) -> None:
        """Hash and index every block whose tokens are now all computed, so later requests can share it. `tokens`:
        the sequence's tokens with those computed but not yet appended (chapter 10's kept drafts)."""
        if not self.enable_prefix_caching:
            return
        tokens = seq.token_ids if tokens is None else tokens
        for i in range(len(seq.block_hashes), seq.num_cached_tokens // self.block_size):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = block_hash(seq.block_hashes[-1] if seq.block_hashes else None, chunk)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = h, chunk
                self.cached.setdefault(h, block.block_id)

    def reset_prefix_cache(self) -> None:
        """Forget what every free block (and the offload tier) holds, so no later request reuses it (blocks in use
        keep theirs)."""
        for block_id in self.free_ids:
            block = self.blocks[block_id]
            if block.hash is not None and self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        if self.offload is not None:
            self.offload.clear()

    def _release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free list, contents kept."""
        for block_id in reversed(block_ids):  # tail blocks first: they are the least likely to be shared
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids[block_id] = None

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references to all its blocks."""
        self._release(seq.block_table)
        seq.block_table, seq.block_hashes = [], []
        seq.num_cached_tokens = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens of the sequence's table (chapter 10: a draft
        model's blocks that held only drafts the target rejected)."""
        keep = self.blocks_needed(num_tokens)
        self._release(seq.block_table[keep:])
        del seq.block_table[keep:], seq.block_hashes[keep:]
