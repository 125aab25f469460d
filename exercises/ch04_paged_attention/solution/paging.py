"""A solution to exercise 4 written from the stub's signatures and docstrings alone, never from minillm.

`python -m exercises.selfcheck` grades it: full marks prove that the stub says everything the grader and
minillm's Scheduler need (a signature the engine calls, a policy the grader compares). It lives in its own
folder so that the stub finder sees one student file.
"""

import hashlib
from array import array
from dataclasses import dataclass

import torch


@dataclass
class Block:
    """One physical block of the KV pool. (Given in the stub.)"""

    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


def block_hash(prev_hash: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """Chained SHA-256 of a full block. (Given in the stub.)"""
    return hashlib.sha256((prev_hash or b"") + array("q", token_ids).tobytes()).digest()


class BlockManager:
    """A pool of blocks with reference counts, an ordered free list and an index of full blocks by hash."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_list = dict.fromkeys(range(num_blocks))  # insertion order: freed longest ago first
        self.index: dict[bytes, int] = {}
        self.hit_tokens = 0
        self.query_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _pop_free(self) -> int:
        """The first block of the free list, unindexed and wiped, held once."""
        block_id = next(iter(self.free_list))
        del self.free_list[block_id]
        block = self.blocks[block_id]
        if block.hash is not None and self.index.get(block.hash) == block_id:
            del self.index[block.hash]
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def _full_block(self, seq, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _hits(self, seq) -> list[int]:
        """Cached blocks equal to the sequence's leading full blocks, stopping at the first miss."""
        if not self.prefix_caching:
            return []
        found, h = [], None
        for i in range(seq.num_tokens // self.block_size):
            tokens = self._full_block(seq, i)
            h = block_hash(h, tokens)
            block_id = self.index.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            found.append(block_id)
        return found

    def allocate(self, seq, reserve: int = 0) -> bool:
        hits = self._hits(seq)
        fresh = self.blocks_needed(seq.num_tokens) - len(hits)
        reclaimed = len([b for b in hits if self.blocks[b].ref_count == 0])
        full_hit = len(hits) > 0 and len(hits) * self.block_size >= seq.num_tokens
        copy = 1 if full_hit and self.blocks[hits[-1]].ref_count > 0 else 0
        if fresh + reclaimed + copy + reserve > self.num_free_blocks:
            return False
        for block_id in hits:
            self.free_list.pop(block_id, None)
            self.blocks[block_id].ref_count += 1
        seq.block_table = hits + [self._pop_free() for _ in range(fresh)]
        seq.block_hashes = [self.blocks[b].hash for b in hits]
        seq.num_cached_tokens = min(len(hits) * self.block_size, seq.num_tokens - 1)
        self.hit_tokens += seq.num_cached_tokens
        self.query_tokens += seq.num_tokens
        return True

    def _shared_write_index(self, seq) -> int | None:
        """Index of the block the next computed token lands in, if that block is shared; else None."""
        i = seq.num_cached_tokens // self.block_size
        if i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1:
            return i
        return None

    def can_grow(self, seq, num_tokens: int) -> bool:
        extra = max(0, self.blocks_needed(num_tokens) - len(seq.block_table))
        copy = 0 if self._shared_write_index(seq) is None else 1
        return extra + copy <= self.num_free_blocks

    def grow(self, seq, num_tokens: int) -> list[tuple[int, int]]:
        copies = []
        i = self._shared_write_index(seq)
        if i is not None:
            shared, private = seq.block_table[i], self._pop_free()
            self.blocks[shared].ref_count -= 1
            seq.block_table[i] = private
            seq.block_hashes = seq.block_hashes[:i]
            copies.append((shared, private))
        while len(seq.block_table) < self.blocks_needed(num_tokens):
            seq.block_table.append(self._pop_free())
        return copies

    def commit(self, seq) -> None:
        if not self.prefix_caching:
            return
        for i in range(len(seq.block_hashes), seq.num_cached_tokens // self.block_size):
            tokens = self._full_block(seq, i)
            h = block_hash(seq.block_hashes[i - 1] if i > 0 else None, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = h, tokens
                if h not in self.index:
                    self.index[h] = block.block_id

    def free(self, seq) -> None:
        for block_id in seq.block_table[::-1]:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_list[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_cached_tokens = 0


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    block_size = cache.shape[1]
    used = block_table[:(length + block_size - 1) // block_size]
    return cache[used].reshape(-1, *cache.shape[2:])[:length]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for s in range(q.shape[0]):
        n = int(context_lens[s])
        k = gather_kv(k_cache, block_tables[s], n).float().repeat_interleave(group, dim=1)  # [n, heads, dim]
        v = gather_kv(v_cache, block_tables[s], n).float().repeat_interleave(group, dim=1)
        weights = (torch.einsum("hd,nhd->hn", q[s].float(), k) * scale).softmax(dim=-1)
        out[s] = torch.einsum("hn,nhd->hd", weights, v).to(q.dtype)
    return out
