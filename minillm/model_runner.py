"""Chapter 4 — the model runner, which turns a scheduled step into tensors, runs one forward pass over it and
samples the next tokens.

Chapter 10: a sequence with drafts gets logits at every position it ran, and keeps the drafts its model agrees with
(`spec_decode.accept`) before its own next token. Its tokens attend as decode rows, one per token (`attends_as_decode`),
so a step that checks drafts stays a decode step for the attention kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .attention import AttentionMetadata, MicroBatch
from .kernels import use_cpu_kernel, use_triton
from .kv_cache import KVCache
from .layers import dispatch_mode_active
from .model import CausalLM
from .parallel.executor import MultiprocExecutor
from .parallel.pipeline import StepPlan
from .sampling import TokenLogprobs, apply_masks, apply_penalties, logprobs_of, sample
from .scheduler import SchedulerOutput
from .sequence import Sequence
from .spec_decode import accept


def attends_as_decode(seq: Sequence, num_new_tokens: int) -> bool:
    """Whether a sequence's new tokens attend as decode rows, one per token: a decode (one new token), or a decode
    with drafts to check (chapter 10), whose row j sees the context up to its own position, so the causal mask
    among the drafts lies in the rows' context lengths."""
    return num_new_tokens == 1 or bool(seq.draft_token_ids)


class ModelRunner:
    """Owns the model and its KV cache; one `run` call is one forward pass over the batch.

    Under a parallel layout the model here is rank 0's part, and `executor` runs each pass on every rank,
    the batch split into `executor.num_micro_batches` micro-batches for the pipeline.
    """

    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device,
                 executor: MultiprocExecutor | None = None):
        self.model, self.kv_cache, self.device, self.executor = model, kv_cache, device, executor
        self.block_size = kv_cache.block_size
        self.use_triton = use_triton(device)  # the one place the attention path is chosen
        self.use_cpu_kernel = not self.use_triton and use_cpu_kernel(device, kv_cache.dtype)

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int], as_decode: list[bool] | None = None):
        """Pack the next `n` uncomputed tokens of each sequence; prompt chunks first, then the sequences that attend as
        decode rows, one attention row of the metadata per new token: those `as_decode` marks (by default those of
        `attends_as_decode`).

        Returns (input_ids, positions, metadata, the sequences in packed order).
        """
        if as_decode is None:
            as_decode = [attends_as_decode(s, n) for s, n in zip(seqs, num_new_tokens)]
        order = sorted(range(len(seqs)), key=lambda i: as_decode[i])
        seqs, num_new_tokens, as_decode = ([items[i] for i in order] for items in (seqs, num_new_tokens, as_decode))
        ids, positions, slots, tables, context_lens, query_lens = [], [], [], [], [], []
        width = max(len(s.block_table) for s in seqs)
        for seq, n, decode in zip(seqs, num_new_tokens, as_decode):
            start = seq.num_cached_tokens
            ids.extend(seq.next_token_ids(n))
            positions.extend(range(start, start + n))
            slots.extend(seq.block_table[p // self.block_size] * self.block_size + p % self.block_size
                         for p in range(start, start + n))
            rows = n if decode else 1
            tables += [seq.block_table + [0] * (width - len(seq.block_table))] * rows
            context_lens += range(start + n - rows + 1, start + n + 1)
            query_lens += [n // rows] * rows
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=self.device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=self.device),
            query_lens=query_lens,
            num_prefills=sum(n > 1 for n in query_lens),
            use_triton=self.use_triton,
            # the C kernel bypasses PyTorch's dispatcher: under a dispatch mode (FlopCounterMode, fake tensors)
            # the PyTorch path runs instead, so the mode sees the attention
            use_cpu_kernel=self.use_cpu_kernel and not dispatch_mode_active(),
        )
        return self._tensor(ids), self._tensor(positions), meta, seqs

    def prepare_prefill(self, seqs: list[Sequence]):
        """Every uncomputed token of each sequence (whole prompts)."""
        return self.prepare(seqs, [s.num_uncomputed_tokens for s in seqs])[:3]

    def execute(self, batches: list[MicroBatch], block_copies: list[tuple[int, int]] = ()) -> torch.Tensor:
        """The logits of one forward pass over `batches` (one, unless the pipeline splits the step), in order."""
        if self.executor is None:
            self.kv_cache.copy_blocks(block_copies)
            (mb,) = batches
            return self.model(mb.input_ids, mb.positions, self.kv_cache, mb.meta, mb.logits_indices)
        logits = self.executor.execute(StepPlan(batches, list(block_copies)))
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _micro_batch(self, seqs: list[Sequence], num_new_tokens: list[int], done: list[bool],
                     scored: list[range]) -> MicroBatch:
        """Pack sequences (in the given order) with the rows whose logits are wanted: the prompt positions that
        are scored, the last token of each sequence whose whole context is now computed, and with drafts, every
        position from its last token on."""
        ids, positions, meta, _ = self.prepare(seqs, num_new_tokens)
        indices = None  # the model's default: every sequence's last new token
        if not all(done) or any(scored) or any(s.draft_token_ids for s in seqs):
            rows, start = [], 0
            for s, n, d, pos in zip(seqs, num_new_tokens, done, scored):
                last = len(s.draft_token_ids) + 1 if d else 0
                rows += [start + p - s.num_cached_tokens for p in pos] + list(range(start + n - last, start + n))
                start += n
            indices = torch.tensor(rows, dtype=torch.long, device=self.device)
        return MicroBatch(ids, positions, meta, indices)

    @torch.inference_mode()  # sampling too: with autograd on, greedy's argmax left its C loop (`runs_in_c`)
    def run(self, step: SchedulerOutput) -> list[SeqResult]:
        """One forward pass; a next token for every sequence whose whole context is now computed.

        Logits are taken only where needed: at each such sequence's last token, and at the prompt
        positions of sequences that asked for their prompt's log-probs.
        """
        order = sorted(range(len(step.seqs)), key=lambda i: attends_as_decode(step.seqs[i], step.num_new_tokens[i]))
        seqs, nums = [step.seqs[i] for i in order], [step.num_new_tokens[i] for i in order]
        done = [s.num_cached_tokens + n == s.num_tokens + len(s.draft_token_ids) for s, n in zip(seqs, nums)]
        scored = [s.prompt_logprob_positions(n) for s, n in zip(seqs, nums)]
        parts = 1 if self.executor is None else min(len(seqs), self.executor.num_micro_batches)
        bounds = [len(seqs) * i // parts for i in range(parts + 1)]
        batches = [self._micro_batch(seqs[a:b], nums[a:b], done[a:b], scored[a:b])
                   for a, b in zip(bounds, bounds[1:])]
        logits = self.execute(batches, step.block_copies)
        sample_rows, draft_rows, row = [], {}, 0  # draft_rows: sequence index -> its rows, last token on
        for i, (s, d, pos) in enumerate(zip(seqs, done, scored)):
            row += len(pos)
            if d and s.draft_token_ids:
                draft_rows[i] = range(row, row + len(s.draft_token_ids) + 1)
                row += len(s.draft_token_ids) + 1
            elif d:
                sample_rows.append(row)
                row += 1
        sampled = [s for i, (s, d) in enumerate(zip(seqs, done)) if d and i not in draft_rows]
        sample_logits = logits if len(sample_rows) == len(logits) else logits[sample_rows]
        tokens = sample(apply_penalties(apply_masks(sample_logits, sampled), sampled), [s.params for s in sampled],
                        [s.generator for s in sampled]) if sampled else []
        token_logprobs = self._token_logprobs(sample_logits, sampled, tokens)  # the model's own distribution
        results, row, it = [], 0, iter(zip(tokens, token_logprobs))
        for i, (s, d, pos) in enumerate(zip(seqs, done, scored)):
            prompt_lps = []
            if pos:
                targets = s.token_ids[pos.start + 1:pos.stop + 1]
                prompt_lps = logprobs_of(logits[row:row + len(pos)], targets, s.params.prompt_logprobs)
                row += len(pos)
            if i in draft_rows:
                results.append(self._verify(s, logits[draft_rows[i].start:draft_rows[i].stop], prompt_lps))
                row += len(draft_rows[i])
                continue
            token, lp = next(it) if d else (None, None)
            row += d
            results.append(SeqResult(s, token, lp, prompt_lps, failed=d and token is None))
        return results

    def _verify(self, seq: Sequence, logits: torch.Tensor, prompt_lps: list[TokenLogprobs]) -> SeqResult:
        """A sequence with drafts: the drafts its model keeps, then its own token (chapter 10)."""
        tokens = accept(seq.draft_token_ids, apply_masks(logits, [seq] * len(logits)), seq.params, seq.generator,
                        seq.draft_probs)
        if tokens is None:
            return SeqResult(seq, None, None, prompt_lps, failed=True)
        lps = [None] * len(tokens)
        if seq.params.logprobs is not None:
            lps = logprobs_of(logits[:len(tokens)], tokens, seq.params.logprobs)
        return SeqResult(seq, tokens[-1], lps[-1], prompt_lps, accepted=tuple(zip(tokens[:-1], lps[:-1])))

    @staticmethod
    def _token_logprobs(logits: torch.Tensor, seqs: list[Sequence],
                        tokens: list[int | None]) -> list[TokenLogprobs | None]:
        """Log-probs of each sampled token, for the sequences that asked for them (None for the others, and for a
        row that had nothing to sample)."""
        asked = [i for i, s in enumerate(seqs) if s.params.logprobs is not None and tokens[i] is not None]
        out: list[TokenLogprobs | None] = [None] * len(seqs)
        if asked:
            k = max(seqs[i].params.logprobs for i in asked)
            for i, lp in zip(asked, logprobs_of(logits[asked], [tokens[i] for i in asked], k)):
                k_i = seqs[i].params.logprobs
                lp.top_ids, lp.top_logprobs = lp.top_ids[:k_i], lp.top_logprobs[:k_i]
                out[i] = lp
        return out


class SeqResult(NamedTuple):
    """What one step produced for one sequence."""

    seq: Sequence
    token: int | None  # None for a prompt chunk that stops short of the prompt's end, or when `failed`
    logprobs: TokenLogprobs | None  # of `token`, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprobs]  # of the prompt tokens this step scored (prompt_logprobs)
    failed: bool = False  # its logits had no finite top value: nothing to sample, the sequence ends with "error"
    accepted: tuple[tuple[int, TokenLogprobs | None], ...] = ()  # drafts kept before `token` (chapter 10)
