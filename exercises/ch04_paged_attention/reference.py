"""The minillm code this exercise rebuilds (the grader's reference; not a copy).

`decode_attention` takes the block tables and lengths directly; minillm's takes them bundled in the
attention metadata, so the reference only repackages the arguments and calls minillm's function.
"""

import torch

from minillm.attention import AttentionMetadata, gather_kv
from minillm.attention import decode_attention as _decode_attention
from minillm.block_manager import Block, BlockManager, block_hash

__all__ = ["Block", "block_hash", "BlockManager", "gather_kv", "decode_attention"]
GRADED = [n for n in __all__ if n not in ("Block", "block_hash")]  # given in the stub


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), block_tables=block_tables,
                             context_lens=context_lens, query_lens=[1] * q.shape[0], num_prefills=0)
    return _decode_attention(q, k_cache, v_cache, meta.decode, scale)
