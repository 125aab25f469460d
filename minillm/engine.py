"""The engine loop: requests in, one scheduled forward pass per `step`, token-by-token outputs out."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import torch

from .block_manager import BlockManager
from .config import ModelConfig
from .detokenizer import detokenize_incrementally
from .kv_cache import KVCache, blocks_for_budget
from .metrics import RequestMetrics
from .model import load_model
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestOutput
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence
from .weights import check_architecture, resolve_model

CPU_KV_CACHE_BYTES = 1 << 30  # on a CPU the pool is fixed at 1 GiB, plenty for the default model
GPU_MEMORY_UTILIZATION = 0.85  # on a GPU the pool takes this share of the memory left after the weights


def default_device_dtype(device: str | torch.device | None, dtype: torch.dtype | str | None):
    """cuda/bf16 when a GPU is present, cpu/float32 otherwise; either can be given explicitly."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype; use e.g. 'float32' or 'bfloat16'")
        dtype = getattr(torch, dtype)
    return device, dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)


class LLMEngine:
    """Holds the tokenizer, model, KV cache and scheduler; `add_request`, `step` and `abort` drive it."""

    def __init__(self, model: str | Path | None = None, device=None, dtype=None, load_format: str = "auto",
                 block_size: int = 16, num_kv_blocks: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True):
        from transformers import AutoTokenizer

        if block_size < 1 or max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must all be >= 1")
        self.path = resolve_model(model)
        check_architecture(self.path)
        self.config = ModelConfig.from_dir(self.path)
        self.device, self.dtype = default_device_dtype(device, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        self.model = load_model(self.path, self.config, self.dtype, self.device, load_format)
        if num_kv_blocks is None:
            num_kv_blocks = blocks_for_budget(self.config, block_size, self.dtype, self._kv_budget())
        self.kv_cache = KVCache.allocate(self.config, num_kv_blocks, block_size, self.dtype, self.device)
        self.block_manager = BlockManager(num_kv_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device)
        self.max_model_len = min(self.config.max_position_embeddings, num_kv_blocks * block_size)
        self.eos_token_ids = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._sequences: dict[str, Sequence] = {}
        self._ids = itertools.count()

    def _kv_budget(self) -> int:
        if self.device.type != "cuda":
            return CPU_KV_CACHE_BYTES
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free * GPU_MEMORY_UTILIZATION)

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """Token ids of a prompt (text is encoded with the tokenizer's own special-token rules)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return None, list(prompt)

    def validate(self, token_ids: list[int]) -> None:
        """Reject a prompt the engine cannot run, before any state changes."""
        if not token_ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {self.config.vocab_size}): {bad[:5]}")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; this model's context is {self.max_model_len}"
                             " (including at least one generated token)")

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> str:
        """Queue a request; it starts running on a later `step`. Returns its id."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self.tokenize(prompt)
        self.validate(token_ids)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        metrics = RequestMetrics(arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
                                 prompt_tokens=len(token_ids))
        seq = Sequence(request_id, text, token_ids, params, metrics)
        self._sequences[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its KV blocks are freed at once."""
        seq = self._sequences.pop(str(request_id), None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            seq.metrics.finished_time = time.perf_counter()

    def next_token_logits(self, prompt: str | list[int]) -> torch.Tensor:
        """The model's scores for the token after `prompt` (float32, `[vocab]`), with no request left behind."""
        text, token_ids = self.tokenize(prompt)
        self.validate(token_ids)
        seq = Sequence("logits", text, token_ids, SamplingParams(), RequestMetrics(time.perf_counter()))
        if not self.block_manager.allocate(seq):
            raise ValueError("the KV cache is busy: no free blocks for this prompt right now")
        try:
            ids, positions, meta = self.runner.prepare_prefill([seq])
            return self.model.prefill(ids, positions, self.kv_cache, meta)[0].float()
        finally:
            self.block_manager.free(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward pass; return the state of every request that got a new token."""
        scheduled = self.scheduler.schedule()
        if not scheduled.seqs:
            return []
        results = self.runner.run(scheduled)
        now = time.perf_counter()
        outputs = []
        for seq, n in zip(scheduled.seqs, scheduled.num_new_tokens):
            seq.num_cached_tokens += n
            self.block_manager.commit(seq)
        for seq, token in results:
            if token is None:
                continue  # a prompt chunk: no token yet
            seq.output_token_ids.append(token)
            seq.metrics.record_token(now)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                seq.metrics.finished_time = now
                self._sequences.pop(seq.request_id, None)
            outputs.append(self._output(seq))
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Extend the detokenized text and say whether the sequence is done ("stop", "length") or not (None)."""
        params = seq.params
        self._detokenize(seq)
        if params.stop:
            hits = [i for i in (seq.text.find(s) for s in params.stop) if i >= 0]
            if hits:
                seq.text = seq.text[:min(hits)]
                return "stop"
        reason = None
        if token in self.eos_token_ids and not params.ignore_eos:
            reason = "stop"
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self._detokenize(seq, final=True)  # a character cut off by the end is shown, as a full decode would
        return reason

    def _detokenize(self, seq: Sequence, final: bool = False) -> None:
        delta, seq.prefix_offset, seq.read_offset = detokenize_incrementally(
            self.tokenizer, seq.output_token_ids, seq.prefix_offset, seq.read_offset, final)
        seq.text += delta

    def _output(self, seq: Sequence) -> RequestOutput:
        completion = CompletionOutput(0, seq.text, list(seq.output_token_ids), seq.finish_reason)
        return RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_token_ids), [completion],
                             seq.is_finished, seq.metrics)

    def stats(self) -> dict:
        """KV pool occupancy and scheduler counters."""
        return {
            "kv_blocks_total": self.block_manager.num_blocks,
            "kv_blocks_free": self.block_manager.num_free_blocks,
            "block_size": self.block_manager.block_size,
            "kv_cache_bytes": self.kv_cache.nbytes,
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_tokens": self.block_manager.hit_tokens,
            "prefix_cache_query_tokens": self.block_manager.query_tokens,
            "max_model_len": self.max_model_len,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        }
