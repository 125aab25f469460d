"""Chapter 9 — prefill instances and decode instances in processes of their own, and the coordinator between them.

`PDPair(...)` starts one prefill and one decode engine (`num_prefill` and `num_decode` for a pool of P + D, the
same `EngineArgs` each, threads split between them), each in a spawned process whose KV connector joins the
pool's gloo group on 127.0.0.1. Each request goes prefill -> transfer -> decode: the coordinator sends it to the
prefill instance with the fewest prefills in hand, which computes the prompt and the first token and holds the
prompt's blocks; the coordinator passes its handle to the decode instance with the fewest requests, which pulls
the blocks and decodes the rest (vLLM's disaggregated proxy does the same with `kv_transfer_params`). Outputs
come from the decode instance as it produces them, in the request's `output_kind`, so a server streams them.

A pool is driven like an `LLMEngine` (`add_request` / `step` / `abort`, `stats`, the tokenizer and chat template),
from two threads as `AsyncLLM` does: that is how `python -m minillm serve --pd 1:1` serves it. The processes stop
with the pool, when this process exits or dies, or when any instance fails; a failure is raised from `step`
rather than waited on.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from pathlib import Path

import torch.multiprocessing as mp

from ..chat_template import conversation_ids
from ..config import ModelConfig
from ..engine import check_allowed_token_ids, check_prompt, check_stop_token_ids, truncate_prompt
from ..engine_args import EngineArgs
from ..output_processor import OutputProcessor
from ..outputs import RequestOutput
from ..ports import free_port
from ..parallel.executor import stop_processes
from ..sampling import RequestOutputKind, SamplingParams
from ..sequence import claim_request_id
from ..threads import engine_threads
from ..weights import resolve_model
from .connector import check_remote_decode
from .instance import ABORT, ADD, DECODE, PREFILL, RESET_PREFIX_CACHE, STATS, STOP, instance_main
from .kv_transfer import pd_ranks

STEP_WAIT_S = 0.002  # how long `step` waits for news from the instances


@dataclass
class _Request:
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prefill_at: int  # the prefill instance it went to
    decode_at: int | None = None  # the decode instance, once its K/V are handed over
    prefill: RequestOutput | None = None  # the prefill instance's output, once its K/V are handed over
    sent_prompt_logprobs: bool = False
    aborted: bool = False


@dataclass
class _Instance:
    role: str
    index: int
    process: mp.Process
    commands: object  # its multiprocessing queue of commands
    results: object  # the read end of its pipe of results
    load: dict | None = None  # its last load report (`instance.load`)
    unreported: int = 0  # sequences sent to it since that report
    active: int = 0  # requests it holds now, by the coordinator's count
    taken: int = 0  # requests it was ever sent

    def take(self, num_seqs: int) -> None:
        self.active, self.taken, self.unreported = self.active + 1, self.taken + 1, self.unreported + num_seqs

    @property
    def name(self) -> str:
        return f"the {self.role} instance {self.index}"


class PDPair:
    """Prefill engines and decode engines behind `generate`, or `add_request` / `step` / `abort` as on an
    `LLMEngine` (so `bench.replay` and `AsyncLLM` drive a pool as they drive an engine)."""

    def __init__(self, model: str | Path | EngineArgs | None = None, *, num_prefill: int = 1, num_decode: int = 1,
                 prefill_threads: int | None = None, decode_threads: int | None = None, hold_timeout: float = 60.0,
                 start_timeout: float = 300.0, **kwargs):
        """`PDPair(EngineArgs(...))` or `PDPair(path, device="cpu", ...)`: every instance gets these engine
        arguments; threads are `num_threads` (default: `threads.engine_threads()`) split evenly over the
        `num_prefill` + `num_decode` instances unless given per instance. A prefill's blocks are freed if no pull
        comes within `hold_timeout` seconds."""
        from transformers import AutoTokenizer

        args = model if isinstance(model, EngineArgs) else EngineArgs(model=model, **kwargs)
        if isinstance(model, EngineArgs) and kwargs:
            args = replace(args, **kwargs)
        if args.tensor_parallel_size * args.pipeline_parallel_size > 1:
            raise ValueError("each instance of a prefill/decode pool runs in one process here (no tensor or pipeline "
                             "parallelism)")
        for name, count in (("num_prefill", num_prefill), ("num_decode", num_decode)):
            if not isinstance(count, int) or count < 1:
                raise ValueError(f"{name} must be a whole number of at least 1, got {count!r}")
        share = max(1, engine_threads(args.num_threads) // (num_prefill + num_decode))
        threads = {PREFILL: prefill_threads or share, DECODE: decode_threads or share}
        self.path = path = resolve_model(args.model)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.config = ModelConfig.from_dir(path)
        prefill_ranks, decode_ranks = pd_ranks(num_prefill, num_decode)
        spawn, port, world = mp.get_context("spawn"), free_port(), num_prefill + num_decode
        self._instances: dict[str, list[_Instance]] = {PREFILL: [], DECODE: []}
        writers = []
        for role, ranks, peers in ((PREFILL, prefill_ranks, decode_ranks), (DECODE, decode_ranks, prefill_ranks)):
            for index, rank in enumerate(ranks):
                commands, (reader, writer) = spawn.Queue(), spawn.Pipe(duplex=False)
                process = spawn.Process(target=instance_main, daemon=True, name=f"minillm-{role}{index}",
                                        args=(role, replace(args, num_threads=threads[role]), rank, world, peers,
                                              port, os.getpid(), hold_timeout, commands, writer))
                self._instances[role].append(_Instance(role, index, process, commands, reader))
                writers.append(writer)
        for inst in self._all():
            inst.process.start()
        for writer in writers:
            writer.close()  # the instance holds the other end: its death then ends our reads
        self._stopper = weakref.finalize(self, _stop, self._instances)
        self._lock = threading.RLock()  # requests are added and aborted from one thread and stepped in another
        self._requests: dict[str, _Request] = {}  # unfinished, by id
        self._ready: list[RequestOutput] = []  # outputs not yet returned
        self._rejected: list[str] = []  # what instances refused, not yet raised
        self._replies: dict[tuple[str, int], dict] = {}  # stats replies, by instance
        self._ids = itertools.count()
        started = self._wait_for(lambda: self._replies if len(self._replies) == world else None, start_timeout,
                                 "every instance to start")
        self._replies = {}
        self._facts = started[(DECODE, 0)]  # device, dtype, block size...: the same on every instance
        self.max_model_len = min(s["max_model_len"] for s in started.values())
        self._kv_blocks_total = sum(s["kv_blocks_total"] for s in started.values())
        # token texts for log-probs, as an engine's output processor shows them
        self.output_processor = OutputProcessor(self.tokenizer, set(), self.max_model_len)

    # --- requests -----------------------------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> str:
        """Queue a request on a prefill instance; returns its id (a given id in use is a ValueError). Safe from any
        thread."""
        self._check_open()
        self._check_params(params)
        text, token_ids = self.tokenize(prompt, params.truncate_prompt_tokens)
        arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        with self._lock:
            request_id = claim_request_id(request_id, self._requests, self._ids)
            inst = least_busy(self._instances[PREFILL])
            self._requests[request_id] = _Request(text, token_ids, params, arrival_time, inst.index)
            inst.take(params.n)
            if params.max_tokens == 1:  # nothing to decode: the prefill instance does it all
                self._send(inst, (ADD, request_id, token_ids, params, arrival_time, None))
            else:
                self._send(inst, (ADD, request_id, token_ids, prefill_params(params), arrival_time, True))
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its instances free its blocks, and `step` returns it with finish_reason
        "abort" (unless it finished first). An unknown or finished id is ignored. Safe from any thread."""
        with self._lock:
            request = self._requests.get(str(request_id))
            if request is None or request.aborted:
                return
            request.aborted = True
            self._send(self._instances[PREFILL][request.prefill_at], (ABORT, str(request_id)))
            if request.decode_at is not None:
                self._send(self._instances[DECODE][request.decode_at], (ABORT, str(request_id)))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._ready)

    def num_waiting_seqs(self) -> int:
        """Sequences not yet running on any instance, as the instances last reported, plus those sent since."""
        with self._lock:
            return sum((i.load or {}).get("num_waiting", 0) + i.unreported for i in self._all())

    def step(self, timeout: float = STEP_WAIT_S) -> list[RequestOutput]:
        """Take what the instances sent (waiting up to `timeout` seconds for it), pass prefilled requests on to a
        decode instance, and return the outputs of the requests that have something new. Raises when an instance
        failed (the pool is then shut down), or refused a request `add_request` could not foresee."""
        self._pump(timeout)
        with self._lock:
            done, self._ready = self._ready, []
            rejected, self._rejected = self._rejected, []
        if rejected:  # raised once every message is taken: the other requests' outputs wait for the next step
            self._ready = done + self._ready
            raise ValueError("; ".join(rejected))
        return done

    def _pump(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the instances, then act on each message: route outputs (kept for
        `step`), record loads and replies, abort what an instance refused. Raises (and stops the pool) when an
        instance reported an error or died."""
        self._check_open()
        if timeout:
            insts = self._all()
            wait([*(i.results for i in insts), *(i.process.sentinel for i in insts)], timeout)
        with self._lock:
            messages, failures = self._read()
            for inst, (kind, body) in messages if not failures else ():
                if kind == "outputs":
                    for out in body:
                        self._route(inst, out)
                elif kind == "load":
                    inst.load, inst.unreported = body, 0
                elif kind == "rejected":
                    request_id, message = body
                    inst.active -= 1
                    self.abort(request_id)
                    self._forget(request_id)
                    self._rejected.append(f"request {request_id}: {message}")
                elif kind in ("ready", "stats"):
                    self._replies[(inst.role, inst.index)] = body
        if failures:
            self.shutdown()
            raise RuntimeError("; ".join(failures))

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 timeout: float | None = None) -> list[RequestOutput]:
        """Run every prompt to completion through the pool; final outputs in prompt order. A request still running
        after `timeout` seconds (default: no limit) is aborted, and the call raises TimeoutError."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt")
        for i, (prompt, p) in enumerate(zip(prompts, params)):  # every request checked before any is queued
            try:
                self._check_params(p)
            except ValueError as e:
                raise ValueError(f"sampling_params[{i}]: {e}") from None
            try:
                self.tokenize(prompt, p.truncate_prompt_tokens)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        params = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        ids = [self.add_request(None, prompt, p) for prompt, p in zip(prompts, params)]
        wanted, finished = set(ids), {}
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while len(finished) < len(ids):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{len(ids) - len(finished)} of {len(ids)} requests did not finish within "
                                       f"{timeout} s")
                for out in self.step():
                    if out.request_id in wanted:
                        finished[out.request_id] = out
                    else:
                        self._ready.append(out)  # another caller's: kept for its `step`
        except BaseException:
            if self._stopper.alive:
                for request_id in wanted - finished.keys():
                    self.abort(request_id)
            raise
        return [finished[i] for i in ids]

    # --- what a server uses of an engine ------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int], truncate_prompt_tokens: int | None = None) -> tuple[str | None,
                                                                                                   list[int]]:
        """The prompt's text (None for token ids) and token ids (the last `truncate_prompt_tokens` if set), checked
        against the instances' vocabulary and context."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer(prompt).input_ids
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            text, token_ids = None, list(prompt)
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        token_ids = truncate_prompt(token_ids, truncate_prompt_tokens, self.max_model_len)
        self.validate(token_ids)
        return text, token_ids

    def validate(self, token_ids: list[int]) -> None:
        """Reject a prompt the instances cannot run (empty, ids outside the vocabulary, too long)."""
        check_prompt(token_ids, self.config.vocab_size, self.max_model_len)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Nothing to compile here: each instance compiles a request's grammar in its own process when it takes the
        request (`SamplingParams` has already checked the spec)."""

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, continue_final_message: bool = False,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids of a conversation, as `LLMEngine.apply_chat_template`."""
        return conversation_ids(self.tokenizer, messages, add_generation_prompt, continue_final_message,
                                chat_template_kwargs)

    def stats(self) -> dict:
        """The pool as one engine's stats (`LLMEngine.stats`): queues, blocks and cache counters summed over the
        instances as they last reported; never waits. Per instance, with transfers: `instance_stats`."""
        if self._stopper.alive:
            try:
                self._pump(0)  # the latest loads, also while nothing steps the pool (an idle server)
            except RuntimeError:
                pass  # an instance failed: `step` says so; these are the last loads it reported
        with self._lock:
            loads = [(i.load or {}, i.unreported) for i in self._all()]
        total = {k: sum(load.get(k, 0) for load, _ in loads) for k in ("num_running", "num_waiting_for_remote_kvs",
                                                                        "num_preemptions", "prefix_cache_hit_tokens",
                                                                        "prefix_cache_query_tokens")}
        facts = {k: self._facts[k] for k in ("block_size", "device", "dtype", "quantization", "kv_cache_dtype")}
        return {**facts, **total, "kv_blocks_total": self._kv_blocks_total,
                "kv_blocks_free": sum(load.get("kv_blocks_free", 0) for load, _ in loads),
                "kv_cache_bytes": self._facts["kv_cache_bytes"] * len(loads),
                "num_waiting": sum(load.get("num_waiting", 0) + n for load, n in loads),
                "max_model_len": self.max_model_len, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                "num_prefill_instances": len(self._instances[PREFILL]),
                "num_decode_instances": len(self._instances[DECODE])}

    # --- the instances ------------------------------------------------------------------------------------------

    def instance_stats(self, timeout: float = 60.0) -> dict[str, list[dict]]:
        """Each instance's engine stats, with its KV transfers (`TransferRecord`s), its `Comm` counts and the number
        of prefills whose blocks it holds: {"prefill": [one per instance], "decode": [...]}. Waits for the replies
        (call it where nothing else steps the pool)."""
        self._replies = {}
        for inst in self._all():
            self._send(inst, (STATS,))
        world = len(self._instances[PREFILL]) + len(self._instances[DECODE])
        replies = self._wait_for(lambda: self._replies if len(self._replies) == world else None, timeout,
                                 "the instances' stats")
        self._replies = {}
        return {role: [replies[(role, i.index)] for i in insts] for role, insts in self._instances.items()}

    def reset_prefix_cache(self) -> None:
        """Forget every instance's cached prefixes (between timed runs)."""
        for inst in self._all():
            self._send(inst, (RESET_PREFIX_CACHE,))

    def shutdown(self) -> None:
        """Stop every instance's process (also done when this object is collected, and when this process exits or
        dies); idempotent."""
        self._stopper()

    def __enter__(self) -> PDPair:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # --- internals ----------------------------------------------------------------------------------------------

    def _all(self) -> list[_Instance]:
        return self._instances[PREFILL] + self._instances[DECODE]

    def _route(self, inst: _Instance, out: RequestOutput) -> None:
        """One output from an instance: pass a prefilled request on to a decode instance, or hand the output to
        the caller (the last one finishes the request)."""
        request = self._requests.get(out.request_id)
        if request is None:
            return  # finished already (an abort that crossed its last output)
        handle = out.kv_transfer_params
        if handle is not None:
            inst.active -= 1  # the prefill instance is done with it but for the send
            # an n = 1 request whose first token ended it has nothing to decode
            ended = request.params.n == 1 and out.outputs[0].finish_reason == "stop"
            if not (request.aborted or ended):
                decoder = least_busy(self._instances[DECODE])
                request.prefill, request.decode_at = out, decoder.index
                decoder.take(request.params.n)
                self._send(decoder, (ADD, out.request_id, request.token_ids, decode_params(request.params),
                                     request.arrival_time, handle))
                return
            self._send(inst, (ABORT, out.request_id))  # frees the blocks it holds
            if request.aborted:
                out = replace(out, outputs=[replace(c, finish_reason="abort") for c in out.outputs])
        elif out.finished:
            inst.active -= 1
        if out.finished:
            self._forget(out.request_id)
        delta = request.params.output_kind == RequestOutputKind.DELTA
        prompt_logprobs = None if delta and request.sent_prompt_logprobs else (request.prefill or out).prompt_logprobs
        request.sent_prompt_logprobs = True
        self._ready.append(replace(out, prompt=request.prompt, prompt_logprobs=prompt_logprobs,
                                   kv_transfer_params=None))

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def _check_params(self, params: SamplingParams) -> None:
        """Refuse parameters an instance would refuse, before anything is queued: a refusal from inside `step` would
        come when other requests' outputs are due."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        check_stop_token_ids(params.stop_token_ids, self.config.vocab_size)
        check_allowed_token_ids(params.allowed_token_ids, self.config.vocab_size)
        check_remote_decode(prefill_params(params))

    def _send(self, inst: _Instance, message: tuple) -> None:
        self._check_open()
        inst.commands.put(message)

    def _read(self) -> tuple[list[tuple[_Instance, tuple]], list[str]]:
        """The instances' messages in the order each sent them (hold `_lock`: two readers would split a request's
        outputs), and what failed: an instance's error report, or its exit."""
        insts, messages = self._all(), []
        for inst in insts:
            try:
                while inst.results.poll():
                    messages.append((inst, inst.results.recv()))
            except (EOFError, OSError):
                pass  # its process is gone: said below
        errors = [body for _, (kind, body) in messages if kind == "error"]
        dead = [f"{i.name} exited with code {i.process.exitcode}" for i in insts if i.process.exitcode is not None]
        return messages, errors + dead

    def _wait_for(self, result, timeout: float, what: str):
        """Step until `result()` is not None (outputs meanwhile are kept for the next `step`)."""
        deadline = time.monotonic() + timeout
        while (value := result()) is None:
            if time.monotonic() > deadline:
                self.shutdown()
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
            self._pump(0.05)
        return value

    def _check_open(self) -> None:
        if not self._stopper.alive:
            raise RuntimeError("this prefill/decode pool has been shut down")


def least_busy(instances: list[_Instance]) -> _Instance:
    """The instance holding the fewest requests; among equals, the one sent the fewest so far (round robin)."""
    return min(instances, key=lambda i: (i.active, i.taken))


def prefill_params(params: SamplingParams) -> SamplingParams:
    """What the prefill instance runs of a request: one completion (the engine stops it after its first token), with
    the prompt's log-probs if asked for; its final output only."""
    return replace(params, n=1, output_kind=RequestOutputKind.FINAL_ONLY)


def decode_params(params: SamplingParams) -> SamplingParams:
    """What the decode instance runs: all n completions, the first continuing from the prefill's first token, its
    outputs in the request's own kind (deltas, for a stream)."""
    return replace(params, prompt_logprobs=None)


def _stop(instances: dict[str, list[_Instance]]) -> None:
    """Ask every instance to stop (the decode ones first: each tells the prefill ones' transfer threads to end), wait
    a little, kill what is left."""
    order = instances[DECODE] + instances[PREFILL]
    for inst in order:
        if inst.process.is_alive():
            inst.commands.put((STOP,))
    stop_processes([i.process for i in order], grace=10.0)
    for inst in order:
        inst.commands.cancel_join_thread()  # a message the dead instance never read must not hold up our exit
        inst.results.close()
