"""Chapter 10 — a draft model: a cheaper model with the target's tokenizer (here the same model, quantized to int4)
drafts the next k tokens one by one, with its own paged KV cache, for the engine to check in one pass.

Each drafting sequence has a shadow here: the same token lists (shared, so it sees every token the target appends),
its own block table in the drafter's pool and its own count of computed tokens. A drafting round first catches up
on what the target added since the last round (the whole prompt the first time; later the target's own token, and
the last draft when every draft was kept), then drafts k tokens, one forward pass per token over every drafting
sequence at once. Greedy, a draft is the draft model's argmax; sampling, a draw from the draft model's distribution
q under the request's own temperature, top-k, top-p and min-p, with the same generator, and the rows of q go to the
verifier (`spec_decode.accept`). After the target's step, `sync` rolls each shadow back to the tokens the target
computed (the K/V of rejected drafts are dropped with the blocks that held only them) and frees the shadows of
sequences that finished or were preempted; an aborted sequence's shadow is freed at once (`free`).
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import torch

from .attention import MicroBatch
from .block_manager import BlockManager
from .config import ModelConfig
from .kv_cache import KVCache
from .metrics import RequestMetrics
from .model import CausalLM, load_model
from .model_runner import ModelRunner
from .quant import quantize_model
from .sampling import SamplingParams, apply_masks
from .sequence import Sequence, SequenceStatus
from .spec_decode import SpeculativeConfig, sampling_probs
from .weights import resolve_model


def load_draft_model(config: SpeculativeConfig, target: ModelConfig, target_path: Path, tokenizer, dtype: torch.dtype,
                     device: torch.device, load_format: str = "auto") -> tuple[CausalLM, ModelConfig]:
    """The draft model of a `draft_model` config, quantized as it asks, with its config. A ValueError naming the
    field when it cannot draft for the target: not a model directory, another vocabulary or tokenizer."""
    try:
        path = resolve_model(config.model)
    except ValueError as e:
        raise ValueError(f"speculative_config model: {e}") from None
    draft = ModelConfig.from_dir(path)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config model {str(path)!r} has vocab_size {draft.vocab_size}, the target "
                         f"{target.vocab_size}: a draft model must share the target's tokenizer")
    if path.resolve() != target_path.resolve():
        from transformers import AutoTokenizer

        theirs, ours = AutoTokenizer.from_pretrained(str(path)).get_vocab(), tokenizer.get_vocab()
        if theirs != ours:
            token = next((t for t in sorted(ours.keys() | theirs.keys()) if ours.get(t) != theirs.get(t)))
            raise ValueError(f"speculative_config model {str(path)!r} has another tokenizer: {token!r} is id "
                             f"{theirs.get(token)} there and {ours.get(token)} in the target's")
    if config.quantization is not None and draft.num_experts:
        raise ValueError("speculative_config quantization is not supported for a Mixture-of-Experts draft model here")
    quantization = None if config.quantization is None else (config.quantization, None)
    model = load_model(path, draft, dtype, device, load_format, pack=quantization is None, quantization=quantization)
    if quantization is not None:
        quantize_model(model, *quantization)
    return model, draft


class DraftModel:
    """The draft model with its own KV pool and a shadow sequence per drafting sequence (vLLM's `DraftModelProposer`).
    `max_num_batched_tokens` bounds the tokens of one forward pass, as the target's scheduler does, so a long prompt
    is caught up on in chunks."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device, max_num_batched_tokens: int):
        self.runner = ModelRunner(model, kv_cache, device)
        self.block_manager = BlockManager(kv_cache.num_blocks, kv_cache.block_size, enable_prefix_caching=False)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.shadows: dict[Sequence, Sequence] = {}  # the target's sequence -> its shadow here

    def propose(self, seqs: list[Sequence], ks: list[int]) -> None:
        """Draft up to `ks[i]` tokens for each of `seqs` (decoding: only its last token is not computed yet) into its
        `draft_token_ids`, and when it samples, the draft model's distributions into its `draft_probs`. A sequence
        the drafter's pool has no room for gets no drafts this step."""
        work = [(seq, shadow, k) for seq, k in zip(seqs, ks) if (shadow := self._shadow_for(seq, k)) is not None]
        probs: dict[Sequence, list[torch.Tensor]] = {seq: [] for seq, _, _ in work}
        logits = self._catch_up([shadow for _, shadow, _ in work]) if work else None
        while work:
            rows = apply_masks(logits, [seq for seq, _, _ in work])
            top, argmax = rows.max(dim=-1)
            finite, argmax = top.isfinite().tolist(), argmax.tolist()
            going = []
            for i, (seq, shadow, k) in enumerate(work):
                if not finite[i]:
                    continue  # nothing to draw from: the drafts so far are all
                token = argmax[i]
                if not seq.params.greedy:
                    q = sampling_probs(rows[i:i + 1], seq.params)[0].cpu()
                    token = int(torch.multinomial(q, 1, generator=seq.generator))
                    probs[seq].append(q)
                seq.draft_token_ids.append(token)
                shadow.draft_token_ids.append(token)
                if len(seq.draft_token_ids) < k:
                    going.append((seq, shadow, k))
            work = going
            if work:  # each draft in, the next one's logits out
                logits = self._forward([shadow for _, shadow, _ in work], [1] * len(work))
        for seq, qs in probs.items():
            seq.draft_probs = torch.stack(qs) if qs else None

    def _shadow_for(self, seq: Sequence, k: int) -> Sequence | None:
        """The sequence's shadow, with blocks for its tokens and its first k - 1 drafts (the k-th is drafted, not
        run), or None when the pool cannot hold them (a shadow already there is then freed, to catch up later)."""
        shadow = self.shadows.get(seq)
        if shadow is None:
            shadow = Sequence(seq.request_id, None, seq.prompt_token_ids, seq.params, seq.metrics,
                              output_token_ids=seq.output_token_ids)  # the target's lists: its tokens are ours
            if not self.block_manager.allocate(shadow):
                return None
            self.shadows[seq] = shadow
        if not self.block_manager.can_grow(shadow, seq.num_tokens + k - 1):
            self.free(seq)
            return None
        self.block_manager.grow(shadow, seq.num_tokens + k - 1)
        return shadow

    def _catch_up(self, shadows: list[Sequence]) -> torch.Tensor:
        """Run each shadow's tokens not yet in the drafter's cache, in passes of at most `max_num_batched_tokens`
        tokens; the logits after each one's last token `[shadows, vocab]`, in order."""
        last: dict[Sequence, torch.Tensor] = {}
        pending = shadows
        while pending:
            batch, nums, budget = [], [], self.max_num_batched_tokens
            for shadow in pending:
                if budget == 0:
                    break
                batch.append(shadow)
                nums.append(min(shadow.num_uncomputed_tokens, budget))
                budget -= nums[-1]
            for shadow, row in zip(batch, self._forward(batch, nums)):
                if shadow.num_uncomputed_tokens == 0:
                    last[shadow] = row
            pending = [shadow for shadow in pending if shadow not in last]
        return torch.stack([last[shadow] for shadow in shadows])

    def _forward(self, shadows: list[Sequence], nums: list[int]) -> torch.Tensor:
        """One forward pass of the draft model over the next `nums[i]` tokens of each shadow; the logits after the
        last of them `[shadows, vocab]`, in the order given. Past its prompt a shadow catches up on a token or two
        (the last draft and the target's own token, when every draft was kept): they attend as decode rows, so the
        pass stays a decode step (`ModelRunner.prepare`)."""
        as_decode = [n == 1 or s.num_cached_tokens >= len(s.prompt_token_ids) for s, n in zip(shadows, nums)]
        ids, positions, meta, order = self.runner.prepare(shadows, nums, as_decode)
        count = {id(shadow): n for shadow, n in zip(shadows, nums)}
        last = {id(shadow): end - 1 for shadow, end in zip(order, itertools.accumulate(count[id(s)] for s in order))}
        rows = torch.tensor([last[id(shadow)] for shadow in shadows], device=ids.device)
        logits = self.runner.execute([MicroBatch(ids, positions, meta, rows)])
        for shadow, n in zip(shadows, nums):
            shadow.num_cached_tokens += n
        return logits

    def sync(self) -> None:
        """After the target's step has verified the drafts: free the shadows of sequences no longer running
        (finished, preempted), and roll the others back to the tokens the target has computed, which are the tokens
        the drafter computed too up to the first draft rejected; blocks past the sequence's tokens go back."""
        for seq, shadow in list(self.shadows.items()):
            if seq.status != SequenceStatus.RUNNING:
                self.free(seq)
                continue
            shadow.num_cached_tokens = min(shadow.num_cached_tokens, seq.num_cached_tokens)
            shadow.draft_token_ids.clear()
            self.block_manager.trim(shadow, shadow.num_tokens)

    def free(self, seq: Sequence) -> None:
        """Give back a sequence's shadow and its blocks (nothing to do for a sequence that never drafted)."""
        shadow = self.shadows.pop(seq, None)
        if shadow is not None:
            self.block_manager.free(shadow)

    def warm_up(self) -> None:
        """One throwaway sequence through a prompt pass and two draft passes, so the first request does not pay
        for first calls (kernel selection, memory pools); its blocks are freed."""
        seq = Sequence("warm-up", None, [0] * 16, SamplingParams(), RequestMetrics(time.perf_counter()))
        try:
            if self.block_manager.allocate(seq) and self.block_manager.can_grow(seq, 18):
                self.block_manager.grow(seq, 18)
                seq.draft_token_ids = [0, 0]
                for n in (16, 1, 1):
                    self._forward([seq], [n])
        finally:
            self.block_manager.free(seq)
