"""Chapter 9 — a prefill instance and a decode instance in two processes, and the coordinator routing between them.

`PDPair(...)` starts both engines (the same `EngineArgs`, threads split between them), each in a spawned process
whose KV connector joins the pair's gloo group on 127.0.0.1. Each request goes prefill -> transfer -> decode: the
prefill instance computes the prompt and the first token and holds the prompt's blocks; the coordinator passes
its handle to the decode instance, which pulls the blocks and decodes the rest (vLLM's disaggregated proxy does
the same with `kv_transfer_params`). The processes stop with the pair, when this process exits or dies, or when
either fails; a failure is raised here rather than waited on.
"""

from __future__ import annotations

import itertools
import os
import time
import weakref
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from pathlib import Path

import torch.multiprocessing as mp

from ..config import ModelConfig
from ..engine import check_allowed_token_ids, check_prompt, check_stop_token_ids
from ..engine_args import EngineArgs
from ..outputs import RequestOutput
from ..parallel.comm import free_port
from ..parallel.executor import stop_processes
from ..sampling import RequestOutputKind, SamplingParams
from ..sequence import claim_request_id
from ..threads import engine_threads
from ..weights import resolve_model
from .connector import check_remote_decode
from .instance import ABORT, ADD, DECODE, PREFILL, RESET_PREFIX_CACHE, STATS, STOP, instance_main

STEP_WAIT_S = 0.002  # how long `step` waits for news from the instances


@dataclass
class _Request:
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prefill: RequestOutput | None = None  # the prefill instance's output, once its K/V are handed over
    aborted: bool = False


class PDPair:
    """Two engines, one for prefills and one for decodes, behind `generate`, or `add_request` / `step` / `abort` as
    on an `LLMEngine` (so `bench.replay` drives a pair as it drives an engine). Outputs are final ones only."""

    def __init__(self, model: str | Path | EngineArgs | None = None, *, prefill_threads: int | None = None,
                 decode_threads: int | None = None, hold_timeout: float = 60.0, start_timeout: float = 300.0,
                 **kwargs):
        """`PDPair(EngineArgs(...))` or `PDPair(path, device="cpu", ...)`: both instances get these engine arguments;
        threads are `num_threads` (default: `threads.engine_threads()`) split evenly unless given per instance. A
        prefill's blocks are freed if no pull comes within `hold_timeout` seconds."""
        from transformers import AutoTokenizer

        args = model if isinstance(model, EngineArgs) else EngineArgs(model=model, **kwargs)
        if isinstance(model, EngineArgs) and kwargs:
            args = replace(args, **kwargs)
        if args.tensor_parallel_size * args.pipeline_parallel_size > 1:
            raise ValueError("each instance of a prefill/decode pair runs in one process here (no tensor or pipeline "
                             "parallelism)")
        half = max(1, engine_threads(args.num_threads) // 2)
        threads = {PREFILL: prefill_threads or half, DECODE: decode_threads or half}
        path = resolve_model(args.model)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.vocab_size = ModelConfig.from_dir(path).vocab_size
        spawn, port = mp.get_context("spawn"), free_port()
        self._commands = {role: spawn.Queue() for role in (PREFILL, DECODE)}
        pipes = {role: spawn.Pipe(duplex=False) for role in (PREFILL, DECODE)}
        self._results = {role: reader for role, (reader, _) in pipes.items()}
        self._procs = {role: spawn.Process(target=instance_main, daemon=True, name=f"minillm-{role}",
                                           args=(role, replace(args, num_threads=threads[role]), port, os.getpid(),
                                                 hold_timeout, self._commands[role], pipes[role][1]))
                       for role in (PREFILL, DECODE)}
        for p in self._procs.values():
            p.start()
        for _, writer in pipes.values():
            writer.close()  # the instance holds the other end: its death then ends our reads
        self._stopper = weakref.finalize(self, _stop, self._procs, self._commands, self._results)
        self._requests: dict[str, _Request] = {}  # unfinished, by id
        self._finished: list[RequestOutput] = []  # final outputs not yet returned
        self._replies: dict[str, dict] = {}  # stats replies, by instance
        self._ids = itertools.count()
        self.instance_stats = self._wait_for(lambda: self._replies if len(self._replies) == 2 else None,
                                             start_timeout, "both instances to start")
        self.max_model_len = min(s["max_model_len"] for s in self.instance_stats.values())

    # --- requests -----------------------------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> str:
        """Queue a request on the prefill instance; returns its id (a given id in use is a ValueError)."""
        self._check_open()
        self._check_params(params)
        text, token_ids = self._tokenize(prompt)
        request_id = claim_request_id(request_id, self._requests, self._ids)
        arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self._requests[request_id] = _Request(text, token_ids, params, arrival_time)
        if params.max_tokens == 1:  # nothing to decode: the prefill instance does it all
            final_only = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
            self._send(PREFILL, (ADD, request_id, token_ids, final_only, arrival_time, None))
        else:
            self._send(PREFILL, (ADD, request_id, token_ids, prefill_params(params), arrival_time, True))
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; both instances free its blocks, and `step` returns it with finish_reason
        "abort" (unless it finished first). An unknown or finished id is ignored."""
        request = self._requests.get(str(request_id))
        if request is not None and not request.aborted:
            request.aborted = True
            for role in (PREFILL, DECODE):
                self._send(role, (ABORT, str(request_id)))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._finished)

    def step(self, timeout: float = STEP_WAIT_S) -> list[RequestOutput]:
        """Take what the instances sent (waiting up to `timeout` seconds for it), pass prefilled requests on to the
        decode instance, and return the final outputs of the requests that finished."""
        self._check_open()
        rejected = []
        for role, (kind, body) in self._receive(timeout):
            if kind == "outputs":
                for out in body:
                    self._route(role, out)
            elif kind == "rejected":  # `add_request` refuses what it can foresee; this is anything else
                request_id, message = body
                self.abort(request_id)
                self._requests.pop(request_id, None)
                rejected.append(f"request {request_id}: {message}")
            elif kind in ("ready", "stats"):
                self._replies[role] = body
        if rejected:  # raised once every message is taken: the other requests' outputs wait for the next step
            raise ValueError("; ".join(rejected))
        done, self._finished = self._finished, []
        return done

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 timeout: float | None = None) -> list[RequestOutput]:
        """Run every prompt to completion through the pair; final outputs in prompt order. A request still running
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
                self._tokenize(prompt)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
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
                        self._finished.append(out)  # another caller's: kept for its `step`
        except BaseException:
            if self._stopper.alive:
                for request_id in wanted - finished.keys():
                    self.abort(request_id)
            raise
        return [finished[i] for i in ids]

    # --- the instances ------------------------------------------------------------------------------------------

    def stats(self, timeout: float = 60.0) -> dict[str, dict]:
        """Each instance's engine stats, with its KV transfers (`TransferRecord`s), its `Comm` counts and the number
        of prefills whose blocks it holds: {"prefill": {...}, "decode": {...}}."""
        self._replies = {}
        for role in (PREFILL, DECODE):
            self._send(role, (STATS,))
        replies = self._wait_for(lambda: self._replies if len(self._replies) == 2 else None, timeout,
                                 "the instances' stats")
        self._replies = {}
        return replies

    def reset_prefix_cache(self) -> None:
        """Forget both instances' cached prefixes (between timed runs)."""
        for role in (PREFILL, DECODE):
            self._send(role, (RESET_PREFIX_CACHE,))

    def shutdown(self) -> None:
        """Stop both instances' processes (also done when this object is collected, and when this process exits or
        dies); idempotent."""
        self._stopper()

    def __enter__(self) -> PDPair:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # --- internals ----------------------------------------------------------------------------------------------

    def _route(self, role: str, out: RequestOutput) -> None:
        """A finished request's output from one instance: pass a prefilled request on to the decode instance, or
        finish the request with it."""
        request = self._requests.get(out.request_id)
        if request is None:
            return  # finished already (an abort that crossed its last output)
        handle = out.kv_transfer_params
        if handle is not None:
            # an n = 1 request whose first token ended it has nothing to decode
            ended = request.params.n == 1 and out.outputs[0].finish_reason == "stop"
            if not (request.aborted or ended):
                request.prefill = out
                self._send(DECODE, (ADD, out.request_id, request.token_ids, decode_params(request.params),
                                    request.arrival_time, handle))
                return
            self._send(PREFILL, (ABORT, out.request_id))  # frees the blocks it holds
            if request.aborted:
                out = replace(out, outputs=[replace(c, finish_reason="abort") for c in out.outputs])
        del self._requests[out.request_id]
        prompt_logprobs = (request.prefill or out).prompt_logprobs
        self._finished.append(replace(out, prompt=request.prompt, prompt_logprobs=prompt_logprobs,
                                      kv_transfer_params=None))

    def _check_params(self, params: SamplingParams) -> None:
        """Refuse parameters an instance would refuse, before anything is queued: a refusal from inside `step` would
        come when other requests' outputs are due."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        check_stop_token_ids(params.stop_token_ids, self.vocab_size)
        check_allowed_token_ids(params.allowed_token_ids, self.vocab_size)
        check_remote_decode(prefill_params(params))

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and token ids, checked against the instances' vocabulary and
        context."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer(prompt).input_ids
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            text, token_ids = None, list(prompt)
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        check_prompt(token_ids, self.vocab_size, self.max_model_len)
        return text, token_ids

    def _send(self, role: str, message: tuple) -> None:
        self._check_open()
        self._commands[role].put(message)

    def _receive(self, timeout: float) -> list[tuple[str, tuple]]:
        """The instances' messages, waiting up to `timeout` seconds for the first; raises (and stops the pair) when
        an instance reported an error or died."""
        wait([*self._results.values(), *(p.sentinel for p in self._procs.values())], timeout)
        messages = []
        for role, conn in self._results.items():
            try:
                while conn.poll():
                    messages.append((role, conn.recv()))
            except (EOFError, OSError):
                pass  # its process is gone: said below
        errors = [body for _, (kind, body) in messages if kind == "error"]
        dead = [f"the {role} instance exited with code {p.exitcode}" for role, p in self._procs.items()
                if p.exitcode is not None]
        if errors or dead:
            self.shutdown()
            raise RuntimeError("; ".join(errors + dead))
        return messages

    def _wait_for(self, result, timeout: float, what: str):
        """Step until `result()` is not None (outputs meanwhile are kept for the next `step`)."""
        deadline = time.monotonic() + timeout
        while (value := result()) is None:
            if time.monotonic() > deadline:
                self.shutdown()
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
            self._finished += self.step(timeout=0.05)
        return value

    def _check_open(self) -> None:
        if not self._stopper.alive:
            raise RuntimeError("this prefill/decode pair has been shut down")


def prefill_params(params: SamplingParams) -> SamplingParams:
    """What the prefill instance runs of a request: one completion (the engine stops it after its first token), with
    the prompt's log-probs if asked for; its final output only."""
    return replace(params, n=1, output_kind=RequestOutputKind.FINAL_ONLY)


def decode_params(params: SamplingParams) -> SamplingParams:
    """What the decode instance runs: all n completions, the first continuing from the prefill's first token."""
    return replace(params, prompt_logprobs=None, output_kind=RequestOutputKind.FINAL_ONLY)


def _stop(procs: dict, commands: dict, results: dict) -> None:
    """Ask both instances to stop (the decode one first: it tells the prefill one's transfer thread to end), wait a
    little, kill what is left."""
    for role in (DECODE, PREFILL):
        if procs[role].is_alive():
            commands[role].put((STOP,))
    stop_processes([procs[DECODE], procs[PREFILL]], grace=10.0)
    for q in commands.values():
        q.cancel_join_thread()  # a message the dead instance never read must not hold up this process's exit
    for conn in results.values():
        conn.close()
