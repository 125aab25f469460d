"""Chapter 1 — benchmark drivers: replay a workload into the engine in process, or (chapter 8) stream it from
any OpenAI-compatible server and summarize what the client saw (`python -m minillm bench`, shaped like
`vllm bench serve`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from .metrics import SLO_KEYS, RequestMetrics, gamma_arrivals, summarize

if TYPE_CHECKING:  # only for type hints: the HTTP client needs neither the engine nor PyTorch
    from .engine import LLMEngine
    from .llm import LLM
    from .outputs import RequestOutput
    from .sampling import SamplingParams

DESCRIPTION = "Benchmark an OpenAI-compatible server as `vllm bench serve` does."
WORKLOADS = {"chat": ((16, 128), (64, 256)), "rag": ((256, 1024), (16, 64))}
Prompt = str | list[int] | list[dict]  # text, token ids, or OpenAI chat messages
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}  # the second is vLLM's: usage in every chunk
REPLICA_HEADER = "x-minillm-replica"  # chapter 9's service names the replica that served a response


# --- workloads: (prompt, max_tokens) pairs ------------------------------------------------------------------

def corpus_ids(tokenizer) -> list[int]:
    """Token ids of the text shipped inside the package (`minillm.perplexity.eval_text`: prose on several topics,
    then some code), so a seeded workload is the same wherever minillm is installed."""
    from .perplexity import eval_text  # here: importing this module must not load PyTorch (the HTTP client)

    return tokenizer(eval_text(), verbose=False).input_ids


def make_workload(name: str, n: int, tokenizer, seed: int = 0) -> list[tuple[list[int], int]]:
    """`n` (prompt ids, max_tokens) pairs: windows of the corpus, lengths drawn uniformly from the ranges."""
    (p_lo, p_hi), (o_lo, o_hi) = WORKLOADS[name]
    ids, rng = corpus_ids(tokenizer), random.Random(seed)
    work = []
    for _ in range(n):
        length = rng.randint(p_lo, p_hi)
        start = rng.randrange(0, max(1, len(ids) - length))
        prompt = (ids * (1 + length // len(ids)))[start:start + length]
        work.append((prompt, rng.randint(o_lo, o_hi)))
    return work


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _line_error(obj) -> str | None:
    """Why one parsed JSONL line is not a request, or None when it is one."""
    if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
        return 'need a JSON object with exactly one of "prompt" or "messages"'
    prompt = obj.get("prompt", obj.get("messages"))
    if "prompt" in obj and not (isinstance(prompt, str) and prompt or isinstance(prompt, list) and prompt
                                and all(_is_count(t) and t >= 0 for t in prompt)):
        return '"prompt" must be a non-empty string or list of token ids'
    if "messages" in obj and not (isinstance(prompt, list) and prompt
                                  and all(isinstance(m, dict) and "role" in m for m in prompt)):
        return '"messages" must be a non-empty list of chat messages ({"role": ..., "content": ...})'
    if "max_tokens" in obj and not (_is_count(obj["max_tokens"]) and obj["max_tokens"] >= 1):
        return f'"max_tokens" must be an integer >= 1, got {obj["max_tokens"]!r}'
    return None


def load_jsonl(path: str | Path, max_tokens: int) -> list[tuple[Prompt, int]]:
    """Requests from a JSONL file, one object a line: "prompt" (text or token ids) or "messages" (OpenAI chat
    messages), and an optional "max_tokens" (default `max_tokens`). Blank lines are skipped."""
    work = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {number}: not JSON ({e.msg})") from None
        if why := _line_error(obj):
            raise ValueError(f"{path} line {number}: {why}")
        work.append((obj.get("prompt", obj.get("messages")), obj.get("max_tokens", max_tokens)))
    if not work:
        raise ValueError(f"{path} holds no requests")
    return work


def for_endpoint(work: Sequence[tuple[Prompt, int]], endpoint: str, tokenizer=None) -> list[tuple[Prompt, int]]:
    """Shape prompts for an endpoint: completions takes text or token ids; chat takes messages, so a text prompt
    becomes one user message, token ids decoded to text first (which needs `tokenizer`)."""
    if endpoint not in ("completions", "chat"):
        raise ValueError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")
    out = []
    for i, (prompt, max_tokens) in enumerate(work):
        is_messages = isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
        if endpoint == "completions" and is_messages:
            raise ValueError(f"request {i} holds chat messages; send it to the chat endpoint")
        if endpoint == "chat" and not is_messages:
            text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
            prompt = [{"role": "user", "content": text}]
        out.append((prompt, max_tokens))
    return out


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """vLLM's `--goodput ttft:500 tpot:100` (milliseconds) as a `summarize` SLO: {"ttft_ms": 500, "tpot_ms": 100}."""
    names = [key.removesuffix("_ms") for key in SLO_KEYS]
    slo = {}
    for item in items:
        name, _, value = item.partition(":")
        try:
            bound = float(value)
        except ValueError:
            bound = math.nan
        if name not in names or not bound >= 0:
            raise ValueError(f"bad goodput SLO {item!r}; use NAME:MILLISECONDS with NAME one of {', '.join(names)}")
        slo[f"{name}_ms"] = bound
    return slo


# --- in process: run a workload through an engine, returning outputs in prompt order ------------------------

def _check_arrivals(arrivals: Sequence[float], n: int) -> None:
    if len(arrivals) != n or any(b < a for a, b in zip(arrivals, arrivals[1:])):
        raise ValueError("need one arrival time per prompt, in non-decreasing order")


def _params_list(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    params = list(params) if isinstance(params, (list, tuple)) else [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; pass one or one per prompt")
    return params


def replay(engine: LLMEngine, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams],
           arrivals: Sequence[float]) -> list[RequestOutput]:
    """Open loop: add each prompt when its arrival time (s after the start) comes, step the engine otherwise.

    A request's recorded arrival is its scheduled time, so its TTFT includes any wait behind a step in progress.
    """
    _check_arrivals(arrivals, len(prompts))
    params = _params_list(params, len(prompts))
    ids: list[str] = []
    finished: dict[str, RequestOutput] = {}
    start = time.perf_counter()
    while len(finished) < len(prompts):
        now = time.perf_counter()
        while len(ids) < len(prompts) and start + arrivals[len(ids)] <= now:
            i = len(ids)
            ids.append(engine.add_request(None, prompts[i], params[i], arrival_time=start + arrivals[i]))
        if engine.has_unfinished_requests():
            finished |= {o.request_id: o for o in engine.step() if o.finished and o.request_id in ids}
        else:  # idle until the next arrival
            time.sleep(start + arrivals[len(ids)] - now)
    return [finished[i] for i in ids]


def run_closed_loop(engine: LLMEngine, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams],
                    concurrency: int) -> list[RequestOutput]:
    """Closed loop: keep `concurrency` requests in flight, sending the next prompt as soon as one finishes."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    params = _params_list(params, len(prompts))
    ids: list[str] = []
    finished: dict[str, RequestOutput] = {}
    while len(finished) < len(prompts):
        while len(ids) < len(prompts) and len(ids) - len(finished) < concurrency:
            ids.append(engine.add_request(None, prompts[len(ids)], params[len(ids)]))
        finished |= {o.request_id: o for o in engine.step() if o.finished and o.request_id in ids}
    return [finished[i] for i in ids]


def run_minillm(llm: LLM, work: Sequence[tuple[list[int], int]]) -> dict[str, float]:
    """Offline throughput: every (prompt ids, max_tokens) request submitted at once, greedy, each run to its
    own length (ignore_eos); returns the output tokens and the seconds they took."""
    from .sampling import SamplingParams

    params = [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in work]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if any(len(o.outputs[0].token_ids) != m for o, (_, m) in zip(outs, work)):
        raise RuntimeError("a request stopped before its max_tokens")
    return {"output_tokens": sum(m for _, m in work), "seconds": elapsed}


def run_hf(model, work: Sequence[tuple[list[int], int]], batch: int, pad_id: int) -> dict[str, float]:
    """The Hugging Face baseline: greedy `generate` in static batches of `batch` (left padded), each batch
    running until its longest answer is done; only each request's own `max_tokens` count as output."""
    import torch

    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(work), batch):
            group = work[i:i + batch]
            width, longest = max(len(p) for p, _ in group), max(m for _, m in group)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in group], device=model.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group], device=model.device)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                                 min_new_tokens=longest, do_sample=False, pad_token_id=pad_id)
            if out.shape[1] != width + longest:
                raise RuntimeError(f"generate returned {out.shape[1] - width} new tokens, expected {longest}")
    return {"output_tokens": sum(m for _, m in work), "seconds": time.perf_counter() - start}


# --- over HTTP: stream each request from an OpenAI-compatible server ----------------------------------------

class Chunk(NamedTuple):
    """One streamed chunk as the client saw it: arrival time, whether it carried text, and the cumulative
    completion tokens of its usage (None when it carried no usage)."""

    time: float
    text: bool
    completion_tokens: int | None

    @classmethod
    def read(cls, chunk, now: float) -> Chunk:
        """Observe an openai completions chunk (choices[].text) or chat chunk (choices[].delta.content)."""
        text = any(getattr(c, "text", None) or getattr(getattr(c, "delta", None), "content", None)
                   for c in chunk.choices)
        return cls(now, bool(text), chunk.usage.completion_tokens if chunk.usage else None)


def expand_token_times(chunks: Sequence[Chunk]) -> list[float]:
    """One timestamp per output token. With cumulative usage in text chunks (vLLM's continuous_usage_stats), a
    chunk adding k completion tokens gives k copies of its time; otherwise each chunk with text is one token
    and whatever the last reported usage counts beyond them is placed at the final chunk's time."""
    if any(c.text and c.completion_tokens is not None for c in chunks):
        times, seen = [], 0
        for c in chunks:
            if c.completion_tokens is not None and c.completion_tokens > seen:
                times += [c.time] * (c.completion_tokens - seen)
                seen = c.completion_tokens
        return times
    times = [c.time for c in chunks if c.text]
    total = next((c.completion_tokens for c in reversed(chunks) if c.completion_tokens is not None), len(times))
    return times[:total] + [chunks[-1].time for _ in range(total - len(times))]


@dataclass
class BenchRun:
    """What an HTTP benchmark measured: a record per successful request (in workload order), the errors of
    the failed ones, the wall time from the first scheduled send to the last response, and for each record the
    replica the server said served it (`x-minillm-replica`; None where it names none)."""

    records: list[RequestMetrics]
    errors: list[str]
    duration: float
    served_by: list[str | None] = field(default_factory=list)


async def _stream(client, endpoint: str, model: str, prompt: Prompt, max_tokens: int, arrival: float,
                  options: dict) -> tuple[RequestMetrics, str | None]:
    """Send one streaming request and time its chunks (client-side `perf_counter`); the replica that served it."""
    if endpoint == "chat":  # max_completion_tokens is the chat name, as `vllm bench serve` sends it
        request = client.chat.completions.create(model=model, messages=prompt, max_completion_tokens=max_tokens,
                                                 stream=True, stream_options=STREAM_OPTIONS, **options)
    else:
        request = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                            stream_options=STREAM_OPTIONS, **options)
    chunks, prompt_tokens = [], 0
    async with await request as stream:
        replica = stream.response.headers.get(REPLICA_HEADER)
        async for chunk in stream:
            chunks.append(Chunk.read(chunk, time.perf_counter()))
            prompt_tokens = chunk.usage.prompt_tokens if chunk.usage else prompt_tokens
    finished = time.perf_counter()
    times = expand_token_times(chunks)
    if not times:
        raise RuntimeError("the stream ended without an output token")
    return RequestMetrics(arrival_time=arrival, prompt_tokens=prompt_tokens, first_token_time=times[0],
                          token_times=times, finished_time=finished, output_tokens=len(times)), replica


def _client(base_url: str, timeout: float, connections: int, api_key: str | None = None):
    """An AsyncOpenAI client with no retries and enough connections that the pool never queues a request. Each
    request opens its own connection (a loopback connect, not timed apart): a server may close a kept-alive connection just as
    the client reuses it (llama-server did, after a few requests on one), which without retries would count as a
    failed request."""
    import httpx
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=0)
    pool = DefaultAsyncHttpxClient(limits=limits)
    return AsyncOpenAI(base_url=base_url, api_key=api_key or "minillm", max_retries=0, timeout=timeout,
                       http_client=pool)


async def first_model(base_url: str, timeout: float = 30.0, api_key: str | None = None) -> str:
    """The first model id the server lists at GET /v1/models."""
    async with _client(base_url, timeout, 1, api_key) as client:
        models = (await client.models.list()).data
    if not models:
        raise ValueError(f"{base_url}/models lists no model; pass one")
    return models[0].id


async def run_http(base_url: str, model: str, work: Sequence[tuple[Prompt, int]], arrivals: Sequence[float], *,
                   endpoint: str = "completions", max_concurrency: int | None = None, temperature: float = 0.0,
                   ignore_eos: bool = False, timeout: float = 600.0, progress: bool = False,
                   api_key: str | None = None, users: Sequence[str | None] | None = None) -> BenchRun:
    """Send each (prompt, max_tokens) at its arrival time (s after the start), at most `max_concurrency` in flight,
    as `users[i]` (OpenAI's `user` field) if given.

    A request's arrival is its scheduled time, or the moment a concurrency slot freed if it had to wait for one
    (as `vllm bench serve` times it). Failed requests are collected as errors, never raised.
    """
    from tqdm.auto import tqdm

    _check_arrivals(arrivals, len(work))
    if endpoint not in ("completions", "chat"):
        raise ValueError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    slots = asyncio.Semaphore(max_concurrency or len(work))
    options = {"temperature": temperature, "extra_body": {"ignore_eos": True} if ignore_eos else None}
    if users is not None and len(users) != len(work):
        raise ValueError(f"{len(users)} users for {len(work)} requests")
    records: list[RequestMetrics | None] = [None] * len(work)
    served: list[str | None] = [None] * len(work)
    errors: list[str] = []

    async def one(i: int, client, bar) -> None:
        scheduled = start + arrivals[i]
        await asyncio.sleep(scheduled - time.perf_counter())
        waited = slots.locked()
        async with slots:
            arrival = time.perf_counter() if waited else scheduled
            try:
                user = {} if users is None or users[i] is None else {"user": users[i]}
                records[i], served[i] = await _stream(client, endpoint, model, *work[i], arrival, {**options, **user})
            except Exception as e:  # an HTTP error, a dropped connection, a malformed stream: count it, go on
                cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
                errors.append(f"request {i}: {type(e).__name__}: {e}{cause}")
            bar.update()

    with tqdm(total=len(work), desc="requests", disable=not progress) as bar:
        async with _client(base_url, timeout, max_concurrency or len(work), api_key) as client:
            start = time.perf_counter()
            await asyncio.gather(*(one(i, client, bar) for i in range(len(work))))
            duration = time.perf_counter() - start
    return BenchRun([r for r in records if r is not None], errors, duration,
                    [s for r, s in zip(records, served) if r is not None])


# --- report ---------------------------------------------------------------------------------------------------

LATENCIES = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
             "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}


def format_result(summary: Mapping[str, float], failed: int, percentiles: Sequence[float] = (50, 90, 99),
                  goodput: bool = False) -> str:
    """The summary as `vllm bench serve` prints it: counts and throughputs, then each latency's statistics."""
    def row(name: str, value, fmt: str = ".2f") -> str:
        return f"{name:<40} {value:{fmt}}"

    lines = [f"{' Serving Benchmark Result ':=^50}", row("Successful requests:", summary["completed"], ""),
             row("Failed requests:", failed, ""), row("Benchmark duration (s):", summary["duration"]),
             row("Total input tokens:", summary["total_input_tokens"], ""),
             row("Total generated tokens:", summary["total_output_tokens"], ""),
             row("Request throughput (req/s):", summary["request_throughput"])]
    if goodput:
        lines.append(row("Request goodput (req/s):", summary["goodput"]))
    lines += [row("Output token throughput (tok/s):", summary["output_throughput"]),
              row("Total token throughput (tok/s):", summary["total_token_throughput"])]
    for key, (title, short) in LATENCIES.items():
        lines += [f"{title:-^50}", row(f"Mean {short} (ms):", summary[f"{key}_ms_mean"]),
                  row(f"Median {short} (ms):", summary[f"{key}_ms_median"])]
        lines += [row(f"P{p:g} {short} (ms):", summary[f"{key}_ms_p{p:g}"]) for p in percentiles]
    return "\n".join([*lines, "=" * 50])


def _jsonable(value):
    """Strict JSON for a float that is not finite: null for NaN (no request had it), "inf" for an infinite rate."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    return value


# --- command line -------------------------------------------------------------------------------------------

def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(","))
    except ValueError:
        values = (math.nan,)
    if not all(0 <= p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"need comma-separated numbers in [0, 100], got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `python -m minillm bench` (vLLM `bench serve`'s names)."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI-compatible API root")
    parser.add_argument("--model", default=None, help="model name to request (default: the first at GET /v1/models); "
                        "with --offline, the local model directory")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--dataset", default="chat",
                        help="chat, rag (cut from the text shipped with minillm) or a PATH.jsonl")
    parser.add_argument("--num-prompts", type=int, default=None, help="requests to send (default: 100, or every line)")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens for JSONL lines that give none")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="generate max_tokens every time (vLLM's extension)")
    parser.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs like ttft:500 tpot:100 (e2el too)")
    parser.add_argument("--percentiles", type=_percentiles, default=(50, 90, 99), help='e.g. "50,90,99"')
    parser.add_argument("--save-result", nargs="?", const="", default=None, metavar="PATH",
                        help="write the summary and settings as JSON (default name minillm-bench-...json)")
    parser.add_argument("--result-dir", default=".", help="folder for --save-result")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds without a byte before a request fails")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--tokenizer", default=None, help="local HF directory (default: the default model's)")
    parser.add_argument("--api-key", default=os.environ.get("MINILLM_API_KEY", "").split(",")[0].strip() or None,
                        help="sent as `Authorization: Bearer` (default: the first of $MINILLM_API_KEY's "
                             "comma-separated keys)")
    parser.add_argument("--offline", action="store_true",
                        help="no server: replay the workload into an engine in this process, built from the engine "
                             "flags below (as `vllm bench throughput` does)")
    from .engine_args import EngineArgs  # here, so a client that only imports this module never loads PyTorch

    EngineArgs.add_cli_args(parser, skip=("model",))


def load_tokenizer(path: str | None = None):
    """The tokenizer in a local Hugging Face directory, or the default model's."""
    from transformers import AutoTokenizer

    if path is None:
        from .weights import resolve_model

        path = resolve_model()
    return AutoTokenizer.from_pretrained(str(path))


def _workload(args: argparse.Namespace) -> list[tuple[Prompt, int]]:
    """The requests the options ask for, shaped for the endpoint; the tokenizer is loaded only when needed."""
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.dataset in WORKLOADS:
        tokenizer = load_tokenizer(args.tokenizer)
        return for_endpoint(make_workload(args.dataset, args.num_prompts or 100, tokenizer, args.seed), args.endpoint,
                            tokenizer)
    work = load_jsonl(args.dataset, args.max_tokens)
    if len(work) < (args.num_prompts or 0):
        raise ValueError(f"{args.dataset} holds {len(work)} requests; --num-prompts asks for {args.num_prompts}")
    work = work[:args.num_prompts]
    ids = any(isinstance(p, list) and p and isinstance(p[0], int) for p, _ in work)
    tokenizer = load_tokenizer(args.tokenizer) if args.endpoint == "chat" and ids else None
    return for_endpoint(work, args.endpoint, tokenizer)


def run_offline(args: argparse.Namespace, work: Sequence[tuple[Prompt, int]], arrivals: Sequence[float]) -> BenchRun:
    """The same workload replayed into an engine in this process, built from the engine flags (`EngineArgs`):
    open loop at the arrival times, or closed loop with `--max-concurrency`. Timed by the engine's own records."""
    from .engine import LLMEngine
    from .engine_args import EngineArgs
    from .sampling import SamplingParams

    engine = LLMEngine(EngineArgs.from_cli_args(args))
    try:
        prompts = [engine.apply_chat_template(p) if p and isinstance(p[0], dict) else p for p, _ in work]
        params = [SamplingParams(temperature=args.temperature, max_tokens=m, ignore_eos=args.ignore_eos,
                                 seed=args.seed if args.temperature else None) for _, m in work]
        start = time.perf_counter()
        if args.max_concurrency is not None:
            outs = run_closed_loop(engine, prompts, params, args.max_concurrency)
        else:
            outs = replay(engine, prompts, params, arrivals)
        return BenchRun([o.metrics for o in outs], [], time.perf_counter() - start)
    finally:
        engine.shutdown()


def benchmark(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed options describe, print its table, save it if asked; 0 when any succeeded."""
    slo = parse_goodput(args.goodput or [])
    if args.offline:
        if args.max_concurrency is not None and math.isfinite(args.request_rate):
            raise ValueError("--offline takes --request-rate or --max-concurrency, not both")
        args.tokenizer = args.tokenizer or args.model  # the engine's own model
    work = _workload(args)
    arrivals = gamma_arrivals(args.request_rate, len(work), args.burstiness, args.seed)
    if args.offline:
        from .weights import DEFAULT_MODEL

        model = str(args.model or DEFAULT_MODEL)
        run = run_offline(args, work, arrivals)
    else:
        model = args.model or asyncio.run(first_model(args.base_url, api_key=args.api_key))
        run = asyncio.run(run_http(args.base_url, model, work, arrivals, endpoint=args.endpoint,
                                   max_concurrency=args.max_concurrency, temperature=args.temperature,
                                   ignore_eos=args.ignore_eos, timeout=args.timeout, progress=not args.no_progress,
                                   api_key=args.api_key))
    for error in run.errors[:5]:
        print(error, file=sys.stderr)
    if not run.records:
        print(f"all {len(work)} requests failed", file=sys.stderr)
        return 1
    summary = summarize(run.records, run.duration, slo, args.percentiles)
    print(format_result(summary, len(run.errors), args.percentiles, goodput=bool(slo)))
    if args.save_result is not None:
        now = datetime.now()
        name = args.save_result or f"minillm-bench-{args.endpoint}-{args.request_rate:g}qps-{now:%Y%m%d-%H%M%S}.json"
        path = Path(args.result_dir) / name
        skip = ("goodput", "save_result", "result_dir", "no_progress", "api_key")  # goodput is the summary's, its SLO below
        settings = {k: v for k, v in vars(args).items() if k not in skip}
        result = {"date": now.isoformat(timespec="seconds"), **settings, "model": model, "goodput_slo": slo,
                  "failed": len(run.errors), "errors": run.errors, **summary}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({k: _jsonable(v) for k, v in result.items()}, indent=2) + "\n")
        print(f"saved {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    """`benchmark`, with a bad option or dataset (2) and an unreachable server (1) reported in a line."""
    from openai import APIError

    try:
        return benchmark(args)
    except ValueError as e:  # a bad option or dataset
        print(f"error: {e}", file=sys.stderr)
        return 2
    except APIError as e:  # listing the models failed: no server, or not an OpenAI-compatible one
        print(f"error: {args.base_url}: {e}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    """`python -m minillm bench ...`: benchmark an OpenAI-compatible server; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m minillm bench", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))
