"""Exercise 4 — PagedAttention: a reference-counted KV block manager, and attention through block tables.

Replace each `raise NotImplementedError(...)` with your code, then run `make grade CH=04`.
Plain Python and PyTorch are enough; do not import minillm.block_manager or minillm.attention (that is
what you are rebuilding). `Block` and `block_hash` are given.

The block manager works on the engine's `Sequence` objects (minillm.sequence.Sequence). You read and
write these fields of a sequence:

    seq.token_ids           prompt + output tokens so far (read only)
    seq.num_tokens          len(seq.token_ids) (read only)
    seq.block_table         list of physical block ids, logical block i -> seq.block_table[i]
    seq.block_hashes        chained hashes of the sequence's leading full, computed blocks
    seq.num_cached_tokens   how many of its tokens already have K/V in the cache

The engine drives the manager like this (minillm's Scheduler and LLMEngine.step):

    allocate(seq, reserve=w)            when the request is admitted (False: leave it waiting); w is the
                                        scheduler's watermark while others run, 0 when none does
    can_grow(seq, n) / grow(seq, n)     before a step computes tokens up to position n - 1
    seq.num_cached_tokens += new tokens; commit(seq)     after the step ran
    free(seq)                           when the request finishes or is preempted
"""

import hashlib
from array import array
from dataclasses import dataclass

import torch


@dataclass
class Block:
    """One physical block of the KV pool. (Given: nothing to write here.)"""

    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


def block_hash(prev_hash: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """Chained SHA-256 of a full block: covers its own tokens and, through prev_hash, every block before it. (Given.)"""
    return hashlib.sha256((prev_hash or b"") + array("q", token_ids).tobytes()).digest()


class BlockManager:
    """Hands out fixed-size KV blocks, shares full blocks between equal prefixes, takes them back.

    State to keep:
    - `blocks`: a list of `Block(i)` for i in range(num_blocks), each with its reference count (how many
      sequences hold it in their block table), and, once full and computed, its hash and tokens;
    - a free list of block ids, ordered: the block freed longest ago comes out first. At the start it
      holds 0, 1, ..., num_blocks - 1 in that order. Blocks come back at the END of the list; a cached
      block that a sequence reuses while it is on the free list leaves it from wherever it is;
    - the prefix-cache index, block hash -> block id (only when enable_prefix_caching);
    - the counters `hit_tokens` (tokens that sequences found cached, see `allocate`) and
      `query_tokens` (tokens of every allocated sequence), both starting at 0.

    Taking a block from the free list: remove the FIRST id of the list; if the index maps that block's
    hash to this block, delete that index entry (its contents are about to be overwritten); clear its
    hash and tokens (None and ()) and set its reference count to 1.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        """Set up `num_blocks` free blocks of `block_size` token slots each (attributes num_blocks, block_size)."""
        raise NotImplementedError("BlockManager.__init__: write this method")

    @property
    def num_free_blocks(self) -> int:
        """How many blocks are on the free list."""
        raise NotImplementedError("BlockManager.num_free_blocks: write this property")

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens: ceil(num_tokens / block_size)."""
        raise NotImplementedError("BlockManager.blocks_needed: write this method")

    def allocate(self, seq, reserve: int = 0) -> bool:
        """Give a new (or preempted) sequence, whose block table is empty, blocks for all its tokens.

        `reserve` is how many blocks must still be free afterwards. minillm's Scheduler passes its
        watermark (1 % of the pool, rounded down) while other sequences are running, so that admitting
        a newcomer leaves the running ones room to grow instead of forcing a preemption next step; it
        passes 0 when nothing runs, and 0 (the default) admits whenever the blocks fit.

        Prefix hits (only with prefix caching): walk the sequence's FULL blocks from the first,
        computing each one's chained hash (`block_hash(previous hash or None, tuple of its tokens)`); a
        block is a hit while the index has that hash AND the indexed block's token_ids equal these
        tokens. Stop at the first miss.

        Count what is needed: fresh = blocks_needed(seq.num_tokens) - hits; reclaimed = hits whose
        reference count is 0 (cached, but sitting on the free list); copy = 1 if the hits cover every
        token of the sequence and the last hit block has a reference count > 0 (the last token will be
        recomputed into it, so `grow` will have to copy it), else 0. If fresh + reclaimed + copy + reserve
        exceeds the free blocks, return False and change nothing at all.

        Otherwise: take each hit block off the free list if it is there and add 1 to its reference
        count; the block table is the hits followed by `fresh` blocks taken from the free list;
        seq.block_hashes = the hashes of the hit blocks; seq.num_cached_tokens = min(hits * block_size,
        seq.num_tokens - 1) (at least one token must run through the model to give the next token's
        logits); add that to hit_tokens and seq.num_tokens to query_tokens. Return True.
        """
        raise NotImplementedError("BlockManager.allocate: write this method")

    def can_grow(self, seq, num_tokens: int) -> bool:
        """Whether the free blocks can cover `num_tokens` tokens for this sequence, plus one block for a
        copy-on-write when the block at index seq.num_cached_tokens // block_size exists in its table and
        is shared (reference count > 1)."""
        raise NotImplementedError("BlockManager.can_grow: write this method")

    def grow(self, seq, num_tokens: int) -> list[tuple[int, int]]:
        """Make the block table cover `num_tokens` tokens; return the block copies the cache must make.

        First, copy-on-write: if the block at index i = seq.num_cached_tokens // block_size exists in the
        table and is shared (reference count > 1), take a free block as its private copy, drop one
        reference from the shared block, put the copy at index i of the table, cut seq.block_hashes to
        its first i entries, and record (shared block, copy). Then append blocks taken from the free
        list until the table covers num_tokens tokens. Return the list of (source, destination) copies
        ([] or one pair).
        """
        raise NotImplementedError("BlockManager.grow: write this method")

    def commit(self, seq) -> None:
        """After a step: hash and index every block whose tokens are now all computed (prefix caching only).

        For each full block i from len(seq.block_hashes) up to seq.num_cached_tokens // block_size - 1:
        its hash is block_hash(hash of block i - 1, or None for i = 0; tuple of its tokens); append it to
        seq.block_hashes. If the physical block has no hash yet, store the hash and the tokens in it, and
        index the hash -> block id unless the index already has that hash.
        """
        raise NotImplementedError("BlockManager.commit: write this method")

    def free(self, seq) -> None:
        """Drop the sequence's references, walking its block table from the LAST block to the first.

        A block whose count reaches 0 goes to the end of the free list, keeping its hash and tokens (so
        a later request can still find it). Then empty the table and block_hashes and set
        num_cached_tokens to 0.
        """
        raise NotImplementedError("BlockManager.free: write this method")


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached vectors of one sequence, in token order: `[length, kv_heads, head_dim]`.

    `cache` is one layer's K (or V) pool `[num_blocks, block_size, kv_heads, head_dim]`; `block_table` a
    1-D long tensor of physical block ids, logical block i -> block_table[i]; it may hold more entries
    than the sequence needs (padding). Token p lives at cache[block_table[p // block_size], p % block_size].
    """
    raise NotImplementedError("gather_kv: write this function")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one new token per sequence over its whole cached context, read through block tables.

    q: `[num_seqs, num_heads, head_dim]`; k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`;
    block_tables: `[num_seqs, max_blocks]` long, each row padded with 0 after the sequence's own blocks;
    context_lens: `[num_seqs]` long, the tokens of each sequence in the cache (its new token included).
    Sequence s attends to its tokens 0 .. context_lens[s] - 1 (nothing else: mask the padding) with
    softmax(q k^T * scale) v. Grouped-query attention: num_heads is a multiple g of num_kv_heads, and
    query head h uses KV head h // g. Returns `[num_seqs, num_heads, head_dim]` in q's dtype.
    """
    raise NotImplementedError("decode_attention: write this function")
