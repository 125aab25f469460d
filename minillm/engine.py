"""Chapter 4 — the engine loop: requests in, one scheduled forward pass per `step`, token-by-token outputs out.

Chapter 9 adds prefill/decode disaggregation (vLLM's KV connector): with a `kv_connector`, a request added with
`do_remote_decode` stops after its first token and its output carries a handle (`kv_transfer_params`) while its
blocks stay held for another instance to pull; a request added with `remote_prefill=handle` waits, blocks
allocated, until the pulled K/V are installed, then decodes from the handle's first token. The step does both.

Chapter 10 adds speculative decoding (`speculative_config`): before each step the drafter (prompt lookup, or a draft
model with a KV pool of its own) proposes tokens for every decoding sequence that may speculate, the step checks
them, and a sequence takes the drafts kept and one more token; the K/V of rejected drafts are simply not counted
as computed, so the next step overwrites them, and a draft model rolls its own cache back to match. It also adds
structured output: a request's grammar is compiled when it is added (`compile_grammar`), each of its sequences gets
a matcher, and every token a sequence takes advances its matcher. And a second KV tier (`kv_offloading_size`,
`kv_offload.py`) under the block manager: blocks reloaded from it count as prefix-cache hits, so the step computes
only what neither tier holds.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from .attention import MicroBatch
from .block_manager import BlockManager
from .chat_template import conversation_ids
from .config import ModelConfig
from .disagg.connector import KVConnector
from .draft_model import DraftModel, load_draft_model
from .kv_handoff import KVTransferParams
from .engine_args import EngineArgs
from .kernels import triton_available
from .kv_cache import KVCache, blocks_for_budget, kv_block_bytes
from .kv_offload import GIB, KVOffloadTier, offload_stats
from .metrics import RequestMetrics
from .model import load_model
from .model_runner import ModelRunner, SeqResult
from .output_processor import OutputProcessor, RequestState
from .outputs import RequestOutput
from .parallel.config import ParallelConfig
from .parallel.executor import MultiprocExecutor
from .quant import quantize_model
from .sampling import SamplingParams, TokenLogprobs, bad_words_token_ids, check_token_ids, check_truncate_prompt_tokens
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence, claim_request_id
from .spec_decode import SpeculativeConfig, propose_ngram, speculates
from .structured_output import CompiledGrammar, StructuredOutputManager
from .threads import configure_threads
from .weights import check_architecture, resolve_model

CPU_KV_CACHE_BYTES = 1 << 30  # on a CPU the pool is fixed at 1 GiB, plenty for the default model
GPU_MEMORY_UTILIZATION = 0.85  # on a GPU the pool takes this share of the memory left after the weights

log = logging.getLogger("minillm")


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

    def __init__(self, model: str | Path | EngineArgs | None = None, **kwargs):
        """`LLMEngine(EngineArgs(...))`, or the same fields as keywords: `LLMEngine(path, device="cpu")`."""
        from transformers import AutoTokenizer

        args = model if isinstance(model, EngineArgs) else EngineArgs(model=model, **kwargs)
        if isinstance(model, EngineArgs) and kwargs:
            args = replace(args, **kwargs)
        self.args = args
        self.path = resolve_model(args.model)
        check_architecture(self.path)
        self.config = ModelConfig.from_dir(self.path)
        self.device, self.dtype = default_device_dtype(args.device, args.dtype)
        if self.device.type == "cpu":
            configure_threads(args.num_threads)
        self.parallel = ParallelConfig(args.tensor_parallel_size, args.pipeline_parallel_size,
                                       args.enable_expert_parallel)
        self.parallel.check(self.config)
        if self.parallel.world_size > 1 and args.quantization is not None:
            raise ValueError("quantization is not supported together with tensor or pipeline parallelism here")
        if args.kv_offloading_size is not None and not args.enable_prefix_caching:
            raise ValueError("kv_offloading_size needs enable_prefix_caching: the tier keeps the prefix cache's "
                             "evicted blocks")
        if args.kv_offloading_size is not None and self.parallel.world_size > 1:
            raise ValueError("kv_offloading_size is not supported with tensor or pipeline parallelism here (each "
                             "rank holds a part of every block)")
        if self.config.num_experts and args.quantization is not None:
            raise ValueError("quantization is not supported for Mixture-of-Experts models here (their experts are "
                             "not linear layers that quantize_model replaces)")
        spec = self.speculative_config = SpeculativeConfig.parse(args.speculative_config)
        by_draft_model = spec is not None and spec.method == "draft_model"
        if self.parallel.world_size > 1 and by_draft_model:
            raise ValueError("speculative_config method 'draft_model' is not supported together with tensor or "
                             "pipeline parallelism here")
        check_quantization_device("quantization", args.quantization, self.device)
        check_quantization_device("speculative_config quantization", spec.quantization if by_draft_model else None,
                                  self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        self.executor = None
        if self.parallel.world_size > 1:
            self.executor = MultiprocExecutor(self.path, self.config, self.parallel, self.dtype, self.device,
                                              args.load_format, args.num_threads)
            self.model = self.executor.model
        else:
            quantization = None if args.quantization is None else (args.quantization, args.quantization_group_size)
            self.model = load_model(self.path, self.config, self.dtype, self.device, args.load_format,
                                    pack=args.quantization is None, quantization=quantization)
        try:
            self._build_runtime(args)
        except BaseException:
            self.shutdown()
            raise

    def _build_runtime(self, args: EngineArgs) -> None:
        """Everything after the weights: quantization, the KV cache (on every rank), the scheduler and the
        output processing, then a warm-up."""
        quantization, kv_cache_dtype, block_size = args.quantization, args.kv_cache_dtype, args.block_size
        if quantization is not None:
            quantize_model(self.model, quantization, args.quantization_group_size)
        self.quantization, self.kv_cache_dtype = quantization, kv_cache_dtype
        spec = self.speculative_config
        draft_model, draft_config = None, None
        if spec is not None and spec.method == "draft_model":
            draft_model, draft_config = load_draft_model(spec, self.config, self.path, self.tokenizer, self.dtype,
                                                         self.device, args.load_format)
        local = self.parallel.local_config(self.config, 0)  # rank 0's stage has the most layers
        num_kv_blocks = args.num_kv_blocks
        if num_kv_blocks is None:  # a draft model's pool gets as many blocks, out of the same budget
            budget = self._kv_budget()
            if draft_config is not None:
                ours, theirs = (kv_block_bytes(c, block_size, self.dtype, kv_cache_dtype)
                                for c in (local, draft_config))
                budget = budget * ours // (ours + theirs)
            num_kv_blocks = blocks_for_budget(local, block_size, self.dtype, budget, kv_cache_dtype)
        self.kv_cache = KVCache.allocate(local, num_kv_blocks, block_size, self.dtype, self.device, kv_cache_dtype)
        if self.executor is not None:
            self.executor.start(self.kv_cache, num_kv_blocks, block_size, kv_cache_dtype)
        self.kv_offload = None  # chapter 10: a second tier for the prefix-cache blocks the pool evicts
        if args.kv_offloading_size is not None:
            self.kv_offload = KVOffloadTier(self.kv_cache, int(args.kv_offloading_size * GIB),
                                            args.kv_offloading_backend)
        self.block_manager = BlockManager(num_kv_blocks, block_size, args.enable_prefix_caching, self.kv_offload)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, args.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, self.executor)
        self.max_model_len = context_length(self.config, num_kv_blocks, block_size)
        self.drafter: DraftModel | None = None
        if draft_model is not None:
            self.drafter = DraftModel(draft_model, KVCache.allocate(draft_config, num_kv_blocks, block_size, self.dtype,
                                                                    self.device, kv_cache_dtype),
                                      self.device, args.max_num_batched_tokens)
            self.max_model_len = min(self.max_model_len, draft_config.max_position_embeddings)
        self.eos_token_ids = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.structured_output = StructuredOutputManager(self.tokenizer, self.config.vocab_size, self.eos_token_ids)
        k = spec.num_speculative_tokens if spec else 0
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0  # chapter 10's counters (vLLM's)
        self.accepted_per_position = [0] * k  # how often the draft at each position was kept
        self.kv_connector: KVConnector | None = None  # chapter 9: set by an instance of a prefill/decode pair
        # Requests can be added and aborted from any thread; `step` runs in one thread at a time and takes
        # new requests and aborts between forward passes, so the scheduler is only touched inside a step.
        self._lock = threading.Lock()  # guards the next four
        self._requests: dict[str, RequestState] = {}  # unfinished requests by id
        self._inbox: list[Sequence] = []  # added since the last step
        self._aborts: list[str] = []  # aborted since the last step
        self._ids = itertools.count()
        self._step_lock = threading.Lock()
        self._ready: list[RequestOutput] = []  # final outputs of aborts applied between steps
        self.warmup_seconds = self._warm_up()

    def _warm_up(self) -> float:
        """Run throwaway sequences through prefill and decode before any request comes, so the first request
        does not pay for first calls: kernel selection and memory pools on a CPU, and on a GPU Triton's
        compilation, once per kernel variant (short and long prompts take different tile shapes, and Triton
        specializes on whether a length is a multiple of 16, so the GPU shapes cover both). Blocks are
        freed, nothing is cached or counted. Returns the seconds taken."""
        start = time.perf_counter()
        # (prompt tokens, decode steps): on a GPU, a context that crosses a multiple of 16 while decoding; Triton's
        # interpreter on a CPU compiles nothing, so it gets the CPU's one short sequence
        compiles = self.runner.use_triton and self.device.type == "cuda"
        shapes = [(15, 17), (16, 1), (40, 1), (48, 1)] if compiles else [(16, 2)]
        bm = self.block_manager
        counters = bm.hit_tokens, bm.query_tokens
        for prompt_tokens, decode_steps in shapes:
            n = max(1, min(prompt_tokens, self.max_model_len - decode_steps - 1))
            seq = Sequence("warm-up", None, [0] * n, SamplingParams(max_tokens=decode_steps),
                           RequestMetrics(start))
            try:
                if not bm.allocate(seq):
                    break  # a pool too small for even this: nothing (more) to warm
                for _ in range(decode_steps + 1):
                    if not bm.can_grow(seq, seq.num_tokens):
                        break
                    step = SchedulerOutput(block_copies=bm.grow(seq, seq.num_tokens))
                    step.add(seq, seq.num_uncomputed_tokens)
                    (result,) = self.runner.run(step)
                    seq.num_cached_tokens = seq.num_tokens
                    seq.output_token_ids.append(result.token)
            finally:
                bm.free(seq)
        bm.hit_tokens, bm.query_tokens = counters
        if self.drafter is not None:
            self.drafter.warm_up()
        return time.perf_counter() - start

    def _kv_budget(self) -> int:
        if self.device.type != "cuda":
            return CPU_KV_CACHE_BYTES
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free * GPU_MEMORY_UTILIZATION)

    def tokenize(self, prompt: str | list[int],
                 truncate_prompt_tokens: int | None = None) -> tuple[str | None, list[int]]:
        """Token ids of a prompt (text is encoded with the tokenizer's own special-token rules), only the last
        `truncate_prompt_tokens` of them when it is set (`truncate_prompt`)."""
        if isinstance(prompt, str):
            return prompt, truncate_prompt(self.tokenizer(prompt).input_ids, truncate_prompt_tokens,
                                           self.max_model_len)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return None, truncate_prompt(list(prompt), truncate_prompt_tokens, self.max_model_len)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, continue_final_message: bool = False,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids of a conversation (list of {"role", "content"} dicts) ready for the assistant's reply, or
        with its last message left open to be continued; `chat_template_kwargs` are extra template variables.
        Only the template writes control tokens: one a message spells stays text (`chat_template.py`)."""
        return conversation_ids(self.tokenizer, messages, add_generation_prompt, continue_final_message,
                                chat_template_kwargs)

    def validate(self, token_ids: list[int]) -> None:
        """Reject a prompt the engine cannot run, before any state changes."""
        check_prompt(token_ids, self.config.vocab_size, self.max_model_len)

    def compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The compiled grammar of `params.structured_outputs` (None without one), a ValueError naming the field if
        this tokenizer cannot serve it. Cached by spec, so a server calls it off its event loop first and
        `add_request` then finds it compiled; a server holds the result until then, which keeps it cached."""
        spec = params.structured_outputs
        return None if spec is None else self.structured_output.compile(spec)

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, *, do_remote_decode: bool = False,
                    remote_prefill: KVTransferParams | None = None) -> str:
        """Queue a request; it starts running on a later `step`. Returns its id. Safe from any thread.

        An automatic id (`request_id=None`) is never one already in use; a given id in use is a ValueError.
        With a KV connector (chapter 9): `do_remote_decode` prefills for another instance (one completion, one
        token; the final output's `kv_transfer_params` say where its K/V wait); `remote_prefill` decodes a prompt
        another instance prefilled (`prompt` must be its `prompt_token_ids`), pulling its K/V first.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self.tokenize(prompt, params.truncate_prompt_tokens)
        self.validate(token_ids)
        grammar = self.compile_grammar(params)
        if do_remote_decode or remote_prefill is not None:
            if self.kv_connector is None:
                raise ValueError("do_remote_decode and remote_prefill need a KV connector (a prefill/decode pair's)")
            params = self.kv_connector.check_request(token_ids, params, do_remote_decode, remote_prefill)
        metrics = RequestMetrics(arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
                                 prompt_tokens=len(token_ids))
        with self._lock:
            request_id = claim_request_id(request_id, self._requests, self._ids)
            seqs = self._sequences_for(request_id, text, token_ids, params, metrics, grammar)
            seqs[0].do_remote_decode, seqs[0].remote_prefill = do_remote_decode, remote_prefill
            if remote_prefill is not None and remote_prefill.generator_state is not None and seqs[0].generator:
                seqs[0].generator.set_state(remote_prefill.generator_state)  # it drew the first token there
            self._requests[request_id] = self.output_processor.add_request(
                request_id, text, token_ids, params, metrics, seqs)
            self._inbox += seqs
        return request_id

    def _sequences_for(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams,
                       metrics: RequestMetrics, grammar: CompiledGrammar | None) -> list[Sequence]:
        """One sequence per completion. The n > 1 siblings draw from seeds seed + i, and share the prompt's
        blocks through the prefix cache (the first computes the prompt and its log-probs; the rest wait).
        Each knows the tokens that end it (EOS unless ignore_eos, and stop_token_ids, checked here), the token
        spellings of its bad words, and its own matcher of the request's grammar; allowed_token_ids are checked
        here too."""
        vocab = self.config.vocab_size
        check_stop_token_ids(params.stop_token_ids, vocab)
        check_allowed_token_ids(params.allowed_token_ids, vocab)
        bad_words = bad_words_token_ids(params.bad_words or [],
                                        lambda text: self.tokenizer(text, add_special_tokens=False).input_ids)
        check_token_ids("bad_words", [t for word in bad_words for t in word], vocab)
        stop_ids = frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else self.eos_token_ids)
        if params.n == 1:
            return [Sequence(request_id, text, token_ids, params, metrics, stop_token_ids=stop_ids,
                             bad_words=bad_words, grammar=grammar.matcher() if grammar else None)]
        seqs: list[Sequence] = []
        for i in range(params.n):
            child = replace(params, n=1, seed=None if params.seed is None else (params.seed + i) % 2 ** 64,
                            prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            leader = seqs[0] if seqs and self.block_manager.enable_prefix_caching else None
            seqs.append(Sequence(f"{i}_{request_id}", text, token_ids, child, metrics, index=i, leader=leader,
                                 stop_token_ids=stop_ids, bad_words=bad_words,
                                 grammar=grammar.matcher() if grammar else None))
        return seqs

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is, with finish_reason "abort". Safe from any thread, also mid-step.

        Between steps it is applied at once: the KV blocks are freed and its final output is returned.
        While a step runs, that step applies it after its forward pass and returns the final output with
        its own. An unknown or finished id is ignored (None).
        """
        request_id = str(request_id)
        with self._lock:
            self._aborts.append(request_id)
        if not self._step_lock.acquire(blocking=False):
            return None
        try:
            outputs = self._apply_aborts()
            self._ready += [o for o in outputs if o.request_id != request_id]  # other threads' aborts
        finally:
            self._step_lock.release()
        return next((o for o in outputs if o.request_id == request_id), None)

    def _admit(self) -> None:
        """Hand requests added since the last step to the scheduler."""
        with self._lock:
            seqs, self._inbox = self._inbox, []
        for seq in seqs:
            self.scheduler.add(seq)

    def _apply_aborts(self) -> list[RequestOutput]:
        """Finish every request aborted since the last call; their final outputs."""
        self._admit()
        with self._lock:
            ids, self._aborts = self._aborts, []
            states = [state for i in ids if (state := self._requests.pop(i, None)) is not None]
        if self.kv_connector is not None:  # a finished prefill's blocks, held for a decode that will not come
            for i in set(ids) - {state.request_id for state in states}:
                if (held := self.kv_connector.release(i)) is not None:
                    self.block_manager.free(held)
        now = time.perf_counter()
        for state in states:
            for seq in state.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
                    self.output_processor.on_abort(seq)
                if self.drafter is not None:
                    self.drafter.free(seq)
            state.metrics.finished_time = now
        return [out for state in states if (out := self.output_processor.output(state)) is not None]

    def next_token_logits(self, prompt: str | list[int]) -> torch.Tensor:
        """The model's scores for the token after `prompt` (float32, `[vocab]`), with no request left behind."""
        text, token_ids = self.tokenize(prompt)
        self.validate(token_ids)
        seq = Sequence("logits", text, token_ids, SamplingParams(), RequestMetrics(time.perf_counter()))
        with self._step_lock:
            if not self.block_manager.allocate(seq):
                raise ValueError("the KV cache is busy: no free blocks for this prompt right now")
            try:
                ids, positions, meta = self.runner.prepare_prefill([seq])
                return self.runner.execute([MicroBatch(ids, positions, meta, None)])[0].float()
            finally:
                self.block_manager.free(seq)

    def shutdown(self) -> None:
        """Stop the other ranks' processes of a parallel layout (nothing to do in one process) and a KV connector's
        transfer thread, and remove a KV offload tier's file; idempotent."""
        if getattr(self, "executor", None) is not None:
            self.executor.shutdown()
        if getattr(self, "kv_connector", None) is not None:
            self.kv_connector.close()
        if getattr(self, "kv_offload", None) is not None:
            self.kv_offload.close()

    def reset_prefix_cache(self) -> None:
        """Forget the cached prefixes of finished requests (vLLM's name), e.g. between two timed runs."""
        with self._step_lock:
            self.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """Whether a request is queued or running, or a final output (of an abort) is still to be returned."""
        return bool(self._requests or self._ready)

    def num_waiting_seqs(self) -> int:
        """Sequences not yet running: added since the last step, or waiting in the scheduler."""
        return len(self._inbox) + len(self.scheduler.waiting)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward pass; return the outputs of every request that has something new."""
        with self._step_lock:
            outputs, self._ready = self._ready + self._apply_aborts(), []
            if self.kv_connector is not None:
                outputs += self._finish_kv_transfers()
            self._propose()
            scheduled = self.scheduler.schedule()
            for seq in scheduled.kv_loads:
                self.kv_connector.start_load_kv(seq)
            if scheduled.seqs:
                results = self.runner.run(scheduled)
                outputs += self._apply_aborts()  # aborted while the forward pass ran: their tokens are dropped
                outputs += self._update(scheduled, results)
            for seq in scheduled.seqs:
                seq.draft_token_ids.clear()
                seq.draft_probs = None
            if self.drafter is not None:
                self.drafter.sync()
        return outputs

    def _propose(self) -> None:
        """Draft the next tokens of every running sequence that decodes and may speculate (chapter 10), at most as
        many as its length limits leave room for after the token the step adds anyway."""
        config = self.speculative_config
        if config is None:
            return
        drafting, ks = [], []
        for seq in self.scheduler.running:
            seq.draft_token_ids, seq.draft_probs = [], None
            room = min(seq.params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens) - 1
            if seq.num_uncomputed_tokens == 1 and room >= 1 and speculates(seq.params, len(seq.output_token_ids)):
                drafting.append(seq)
                ks.append(min(config.num_speculative_tokens, room))
        if self.drafter is not None:
            self.drafter.propose(drafting, ks)
            return
        for seq, k in zip(drafting, ks):
            seq.draft_token_ids = propose_ngram(seq.token_ids, k, config.prompt_lookup_min, config.prompt_lookup_max)

    def _update(self, scheduled: SchedulerOutput, results: list[SeqResult]) -> list[RequestOutput]:
        """Commit the step's K/V, append the new tokens, finish what is done; the outputs to report."""
        now = time.perf_counter()
        kept = {id(r.seq): [t for t, _ in r.accepted] for r in results if r.seq.draft_token_ids}
        for seq, n in zip(scheduled.seqs, scheduled.num_new_tokens):
            if not seq.is_finished:
                drafts = kept.get(id(seq))
                if drafts is None:
                    seq.num_cached_tokens += n
                    self.block_manager.commit(seq)
                else:  # the last token and the kept drafts are computed; a rejected draft's K/V are not
                    seq.num_cached_tokens += 1 + len(drafts)
                    self.block_manager.commit(seq, seq.token_ids + drafts)
                    self._count_drafts(len(seq.draft_token_ids), len(drafts))
        touched: dict[str, RequestState] = {}
        handles: dict[str, KVTransferParams] = {}
        for seq, token, logprobs, prompt_logprobs, failed, accepted in results:
            if seq.is_finished:
                continue
            if prompt_logprobs:
                self.output_processor.add_prompt_logprobs(seq, prompt_logprobs)
                seq.num_prompt_logprobs += len(prompt_logprobs)
            if failed:  # its logits were not finite: this sequence ends, the batch carries on
                log.warning("request %s: no finite logit to sample from; it finishes with 'error'", seq.request_id)
                self.scheduler.finish(seq, "error")
                self.output_processor.on_abort(seq)
            elif token is None:
                continue  # a prompt chunk: no token yet
            else:
                for draft, draft_logprobs in accepted:  # the drafts kept come first (chapter 10)
                    self._take_token(seq, draft, draft_logprobs, now)
                    if seq.is_finished:
                        break
                if not seq.is_finished and (handle := self._take_token(seq, token, logprobs, now)) is not None:
                    handles[seq.request_id] = handle
            state = seq.completion.request
            touched[state.request_id] = state
        return self._outputs(touched, now, handles)

    def _count_drafts(self, drafted: int, kept: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += kept
        for position in range(kept):
            self.accepted_per_position[position] += 1

    def _take_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None,
                    when: float) -> KVTransferParams | None:
        """Append a sequence's new token (and advance its grammar's matcher over it), and finish it if that ends it.
        A finished prefill for a remote decode keeps its blocks, held by the KV connector; the handle to them is
        returned."""
        seq.output_token_ids.append(token)
        if seq.grammar is not None:  # its mask allowed only tokens it takes (one refused would leave it in error)
            seq.grammar.consume_token(token)
        seq.metrics.record_token(when)
        reason = self.output_processor.on_token(seq, token, logprobs)
        if reason is None:
            return None
        handle = self.kv_connector.request_finished(seq, logprobs) if seq.do_remote_decode else None
        self.scheduler.finish(seq, reason, free_blocks=handle is None)
        return handle

    def _outputs(self, touched: dict[str, RequestState], now: float,
                 handles: dict[str, KVTransferParams] | None = None) -> list[RequestOutput]:
        """Retire the finished requests among `touched`; the outputs to report (with their KV handles)."""
        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = now
                with self._lock:
                    del self._requests[state.request_id]
        outputs = [out for state in touched.values() if (out := self.output_processor.output(state)) is not None]
        for out in outputs if handles else ():
            out.kv_transfer_params = handles.get(out.request_id)
        return outputs

    def _finish_kv_transfers(self) -> list[RequestOutput]:
        """Free the blocks of prefills the decode instance has pulled (or never will); start the decodes whose K/V
        arrived: each takes the prefill's first token as if it had sampled it here, and runs from the next step."""
        sent, loaded = self.kv_connector.get_finished()
        for seq in sent:
            self.block_manager.free(seq)
        touched: dict[str, RequestState] = {}
        for seq, installed in loaded:
            if seq.is_finished:
                continue  # aborted while its K/V were on the way
            handle = seq.remote_prefill
            self.scheduler.finish_loading(seq, installed)
            self._take_token(seq, handle.first_token, handle.first_logprobs, handle.first_token_time)
            touched[seq.completion.request.request_id] = seq.completion.request
        return self._outputs(touched, time.perf_counter())

    def stats(self) -> dict:
        """KV pool occupancy and scheduler counters."""
        return {
            "kv_blocks_total": self.block_manager.num_blocks,
            "kv_blocks_free": self.block_manager.num_free_blocks,
            "block_size": self.block_manager.block_size,
            "kv_cache_bytes": self.kv_cache.nbytes,
            "num_waiting": self.num_waiting_seqs(),
            "num_running": len(self.scheduler.running),
            "num_waiting_for_remote_kvs": len(self.scheduler.loading),
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_tokens": self.block_manager.hit_tokens,
            "prefix_cache_query_tokens": self.block_manager.query_tokens,
            "max_model_len": self.max_model_len,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "quantization": self.quantization,
            "kv_cache_dtype": self.kv_cache_dtype,
            "tensor_parallel_size": self.parallel.tensor_parallel_size,
            "pipeline_parallel_size": self.parallel.pipeline_parallel_size,
            "spec_decode_num_drafts": self.num_drafts,  # sequence-steps that checked drafts
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
            **offload_stats(self.kv_offload),
            "draft_kv_blocks_total": self.drafter.block_manager.num_blocks if self.drafter else 0,  # a draft model's
            "draft_kv_blocks_free": self.drafter.block_manager.num_free_blocks if self.drafter else 0,
        }


def context_length(config, num_kv_blocks: int, block_size: int) -> int:
    """The longest sequence an engine serves: the model's positions, or fewer if its KV pool holds fewer tokens."""
    return min(config.max_position_embeddings, num_kv_blocks * block_size)


def check_quantization_device(name: str, method: str | None, device: torch.device) -> None:
    """Refuse a quantization (the engine's `name` option) the device has no kernels for (ValueError naming it)."""
    if method is not None and (device.type not in ("cpu", "cuda") or (device.type == "cuda" and method != "fp8"
                                                                       and not triton_available())):
        raise ValueError(f"{name} {method!r} needs a CPU, or a GPU with Triton")


def check_prompt(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Reject a prompt an engine with this vocabulary and context cannot run (ValueError naming why)."""
    if not token_ids:
        raise ValueError("prompt is empty: it must contain at least one token")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(token_ids) >= max_model_len:
        raise ValueError(f"prompt has {len(token_ids)} tokens; this model's context is {max_model_len}"
                         " (including at least one generated token)")


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: as many as the context holds, one
    place left for the reply); a ValueError naming the field when `keep` is more than that, or not a count."""
    if keep is None:
        return token_ids
    check_truncate_prompt_tokens(keep)
    most = max_model_len - 1
    if keep > most:
        raise ValueError(f"truncate_prompt_tokens is {keep}, but this model's context holds at most {most} prompt "
                         "tokens (and one to generate)")
    return token_ids[-(most if keep == -1 else keep):]


def check_stop_token_ids(stop_token_ids: list[int], vocab_size: int) -> None:
    """Reject stop token ids outside this vocabulary (ValueError naming them)."""
    check_token_ids("stop_token_ids", stop_token_ids, vocab_size)


def check_allowed_token_ids(allowed_token_ids: list[int] | None, vocab_size: int) -> None:
    """Reject allowed token ids outside this vocabulary, or more of them than it holds (ValueError naming them)."""
    if allowed_token_ids is None:
        return
    if len(allowed_token_ids) > vocab_size:
        raise ValueError(f"allowed_token_ids has {len(allowed_token_ids)} entries; the vocabulary has {vocab_size}")
    check_token_ids("allowed_token_ids", allowed_token_ids, vocab_size)
