"""Turns a scheduled step into tensors, runs one forward pass over it, and samples the next tokens."""

from __future__ import annotations

import torch

from .attention import AttentionMetadata
from .kernels import use_triton
from .kv_cache import KVCache
from .model import CausalLM
from .sampling import sample
from .scheduler import SchedulerOutput
from .sequence import Sequence


class ModelRunner:
    """Owns the model and its KV cache; one `run` call is one forward pass over the batch."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device):
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.block_size = kv_cache.block_size
        self.use_triton = use_triton(device)  # the one place the attention path is chosen

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int]):
        """Pack the next `n` uncomputed tokens of each sequence; sequences with several tokens (prefill) first.

        Returns (input_ids, positions, metadata, the sequences in packed order).
        """
        order = sorted(range(len(seqs)), key=lambda i: num_new_tokens[i] == 1)
        seqs, num_new_tokens = [seqs[i] for i in order], [num_new_tokens[i] for i in order]
        ids, positions, slots = [], [], []
        for seq, n in zip(seqs, num_new_tokens):
            start = seq.num_cached_tokens
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(seq.block_table[p // self.block_size] * self.block_size + p % self.block_size
                         for p in range(start, start + n))
        width = max(len(s.block_table) for s in seqs)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            block_tables=self._tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs]),
            context_lens=self._tensor([s.num_cached_tokens + n for s, n in zip(seqs, num_new_tokens)]).int(),
            query_lens=num_new_tokens,
            num_prefills=sum(n > 1 for n in num_new_tokens),
            use_triton=self.use_triton,
        )
        return self._tensor(ids), self._tensor(positions), meta, seqs

    def prepare_prefill(self, seqs: list[Sequence]):
        """Every uncomputed token of each sequence (whole prompts)."""
        return self.prepare(seqs, [s.num_uncomputed_tokens for s in seqs])[:3]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate shared blocks (all layers) before a sequence writes into its own copy."""
        for src, dst in copies:
            self.kv_cache.k[:, dst].copy_(self.kv_cache.k[:, src])
            self.kv_cache.v[:, dst].copy_(self.kv_cache.v[:, src])

    def run(self, step: SchedulerOutput) -> list[tuple[Sequence, int | None]]:
        """One forward pass; a next token for every sequence whose whole context is now computed, else None."""
        self.copy_blocks(step.block_copies)
        ids, positions, meta, seqs = self.prepare(step.seqs, step.num_new_tokens)
        done = [s.num_cached_tokens + n == s.num_tokens for s, n in zip(seqs, meta.query_lens)]
        sampled = [s for s, d in zip(seqs, done) if d]
        indices = None  # the model's default: every sequence's last new token
        if not all(done):  # chunks in the middle of a prompt need no logits
            last = torch.tensor(meta.query_lens, device=self.device).cumsum(0) - 1
            indices = last[torch.tensor(done, device=self.device)]
        logits = self.model(ids, positions, self.kv_cache, meta, indices)
        tokens = sample(logits, [s.params for s in sampled], [s.generator for s in sampled]) if sampled else []
        it = iter(tokens)
        return [(s, next(it) if d else None) for s, d in zip(seqs, done)]
