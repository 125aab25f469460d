"""Turns a scheduled batch of sequences into tensors, runs the model's prefill or decode, and samples."""

from __future__ import annotations

import torch

from .attention import AttentionMetadata
from .kv_cache import KVCache
from .model import CausalLM
from .sampling import sample
from .sequence import Sequence


class ModelRunner:
    """Owns the model and its KV cache; one `run` call is one forward pass over the batch."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device):
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.block_size = kv_cache.block_size

    def _slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        return self._tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs])

    def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Pack every sequence's not-yet-cached tokens one after another."""
        ids, positions, slots, query_lens = [], [], [], []
        for seq in seqs:
            start, end = seq.num_cached_tokens, seq.num_tokens
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slot(seq, p) for p in range(start, end))
            query_lens.append(end - start)
        meta = AttentionMetadata(True, self._tensor(slots), self._block_tables(seqs),
                                 self._tensor([s.num_tokens for s in seqs]), query_lens)
        return self._tensor(ids), self._tensor(positions), meta

    def prepare_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Each sequence's last token, whose K/V is not cached yet."""
        positions = [s.num_tokens - 1 for s in seqs]
        meta = AttentionMetadata(False, self._tensor([self._slot(s, p) for s, p in zip(seqs, positions)]),
                                 self._block_tables(seqs), self._tensor([s.num_tokens for s in seqs]),
                                 [1] * len(seqs))
        return self._tensor([s.token_ids[-1] for s in seqs]), self._tensor(positions), meta

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        """One forward pass over the batch, then one sampled token per sequence."""
        if is_prefill:
            ids, positions, meta = self.prepare_prefill(seqs)
            logits = self.model.prefill(ids, positions, self.kv_cache, meta)
        else:
            ids, positions, meta = self.prepare_decode(seqs)
            logits = self.model.decode(ids, positions, self.kv_cache, meta)
        return sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
