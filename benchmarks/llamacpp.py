"""llama.cpp on the default model's own GGUF file (Q4_1 matrices, Q8_0 embedding): the engine a CPU user would
pick instead of minillm, timed the way minillm's benchmarks time minillm, in the same process.

Three figures, each the median over rounds after a warm-up: batch-1 greedy decode (tokens after the first,
so prompt processing is apart), prefill of a 384-token prompt (the cache cleared each round), and the chat
workload of `benchmarks/throughput.py` served one request at a time, every request run to its own length.
`--compare` also times minillm's float32 engine decoding the same prompt and counts how many greedy tokens
the two agree on before they first differ. Needs `llama-cpp-python` (not a requirement of the book):

    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=ON" .venv/bin/pip install llama-cpp-python==0.3.36
    .venv/bin/python -m benchmarks.llamacpp [--threads 1] [--rounds 3] [--requests 16] [--compare]
    .venv/bin/python -m benchmarks.llamacpp --paired int4 [--threads 1] [--rounds 9] [--save FILE.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import save_json
from minillm import threads
from minillm.bench import corpus_ids, make_workload
from minillm.weights import default_gguf_path, resolve_model

INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=ON" .venv/bin/pip install llama-cpp-python==0.3.36'
N_CTX = 1024  # the longest run: a chat request of 128 prompt + 256 answer tokens, or 384 prompt tokens
QUESTION = "Explain in a few paragraphs why the sky is blue, and why sunsets are red."


def available() -> bool:
    """Whether the llama.cpp Python bindings are installed."""
    return importlib.util.find_spec("llama_cpp") is not None


def install_hint() -> str:
    """The command that builds llama.cpp for this CPU (AVX-512 if it has it, OpenMP threads) into the venv."""
    return INSTALL


def load(n_threads: int = 1, n_ctx: int = N_CTX):
    """The default GGUF in llama.cpp, with `n_threads` for decode and prefill alike, and its log kept quiet."""
    if n_threads < 1:
        raise ValueError(f"n_threads must be at least 1, got {n_threads}")
    from llama_cpp import Llama

    return Llama(str(default_gguf_path()), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                 verbose=False)


def tokenizer():
    """The default model's Hugging Face tokenizer: the same vocabulary as the GGUF, so ids pass between them."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model()))


def chat_prompt(tok, question: str = QUESTION) -> list[int]:
    """Token ids of one user turn in the model's chat template, ready for the assistant's answer."""
    return list(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def greedy(llm, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation of `prompt_ids` from an empty cache, `new_tokens` long whatever it says (EOS is
    not a stop); returns the tokens and the `perf_counter` time each was ready, the prompt's start first."""
    import llama_cpp
    import numpy as np

    if not prompt_ids or len(prompt_ids) + new_tokens > llm.n_ctx():
        raise ValueError(f"{len(prompt_ids)} prompt + {new_tokens} new tokens do not fit n_ctx={llm.n_ctx()}")
    vocab = llm.n_vocab()

    def argmax() -> int:  # logits of the last evaluated position, the only row llama.cpp keeps
        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,)).argmax())

    llm.reset()  # the next eval drops every cached position from 0 on
    times = [time.perf_counter()]
    llm.eval(prompt_ids)
    tokens = [argmax()]
    times.append(time.perf_counter())
    while len(tokens) < new_tokens:
        llm.eval([tokens[-1]])
        tokens.append(argmax())
        times.append(time.perf_counter())
    return tokens, times


def decode_tok_s(llm, prompt_ids: list[int], new_tokens: int = 128, rounds: int = 5) -> float:
    """Batch-1 greedy decode, tokens per second after the first token (time per output token inverted)."""
    once = decoder(llm, prompt_ids, new_tokens)
    return statistics.median(once() for _ in range(rounds))


def decoder(llm, prompt_ids: list[int], new_tokens: int):
    """A function timing one batch-1 greedy decode of `prompt_ids` in llama.cpp (tok/s after the first token),
    warmed up."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be at least 2 to time decoding, got {new_tokens}")

    def once() -> float:
        _, times = greedy(llm, prompt_ids, new_tokens)
        return (new_tokens - 1) / (times[-1] - times[1])

    once()  # warm-up
    return once


def prefill_tok_s(llm, prompt_ids: list[int], rounds: int = 5) -> float:
    """Prompt tokens per second of one pass over `prompt_ids`, recomputed from an empty cache each round."""
    def once() -> float:
        _, times = greedy(llm, prompt_ids, 1)
        return len(prompt_ids) / (times[1] - times[0])

    once()  # warm-up
    return statistics.median(once() for _ in range(rounds))


def chat_tok_s(llm, tok, requests: int = 16, rounds: int = 3) -> dict[str, float]:
    """The `chat` workload of benchmarks/throughput.py (same prompts, lengths and seed), one request at a
    time, each to its own max_tokens; output tokens per second of the median round, and its size."""
    work = make_workload("chat", requests, tok)
    prompt, m = make_workload("chat", 1, tok, seed=123)[0]
    greedy(llm, prompt, m)  # warm-up

    def once() -> float:
        start = time.perf_counter()
        for prompt, m in work:
            greedy(llm, prompt, m)
        return time.perf_counter() - start

    seconds = statistics.median(once() for _ in range(rounds))
    tokens = sum(m for _, m in work)
    return {"output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def measure(n_threads: int = 1, rounds: int = 3, requests: int = 16, new_tokens: int = 128,
            prefill_tokens: int = 384) -> dict[str, float]:
    """All three figures for llama.cpp with `n_threads` threads, as one dict of plain numbers."""
    llm, tok = load(n_threads), tokenizer()
    long_prompt = corpus_ids(tok)[:prefill_tokens]
    return {"threads": n_threads,
            "decode_tok_s": decode_tok_s(llm, chat_prompt(tok), new_tokens, rounds),
            "prefill_tok_s": prefill_tok_s(llm, long_prompt, rounds),
            "chat_tok_s": chat_tok_s(llm, tok, requests, rounds)["tok_s"]}


def minillm_decode(prompt_ids: list[int], new_tokens: int = 128, rounds: int = 3,
                   quantization: str | None = None) -> tuple[float, list[int]]:
    """minillm's engine (float32, or `quantization`) on the same prompt: median decode tok/s (1 / time per output
    token, from the request's own timing record) and its greedy tokens. Threads follow `$MINILLM_NUM_THREADS`."""
    once, tokens = minillm_decoder(prompt_ids, new_tokens, quantization)
    return statistics.median(once() for _ in range(rounds)), tokens


def minillm_decoder(prompt_ids: list[int], new_tokens: int, quantization: str | None = None):
    """A function timing one batch-1 greedy decode of `prompt_ids` in minillm (tok/s after the first token), warmed
    up, and the greedy tokens. int4 runs in groups of 32, the grid of the GGUF's Q4_1 blocks."""
    from minillm import LLM, SamplingParams
    from minillm.metrics import tpot

    llm = LLM(enable_prefix_caching=False, quantization=quantization,
              quantization_group_size=32 if quantization == "int4" else None)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    tokens = list(llm.generate([prompt_ids], params, use_tqdm=False)[0].outputs[0].token_ids)  # and a warm-up
    return lambda: 1 / tpot(llm.generate([prompt_ids], params, use_tqdm=False)[0].metrics), tokens


def paired_decode(n_threads: int, prompt_ids: list[int], new_tokens: int, rounds: int,
                  quantization: str | None) -> dict:
    """Batch-1 decode tok/s of llama.cpp and of minillm (float32, or `quantization`) in alternating rounds (the
    order flipped every round), so that a machine whose speed drifts slows both alike: per-round figures and
    the median of minillm's per-round ratio to llama.cpp."""
    theirs_once = decoder(load(n_threads), prompt_ids, new_tokens)
    ours_once, _ = minillm_decoder(prompt_ids, new_tokens, quantization)
    ours, theirs = [], []
    for r in range(rounds):
        for once, into in ((ours_once, ours), (theirs_once, theirs))[::1 if r % 2 == 0 else -1]:
            into.append(once())
    ratios = [a / b for a, b in zip(ours, theirs)]
    return {"threads": n_threads, "format": quantization or "float32", "new_tokens": new_tokens, "rounds": rounds,
            "minillm_tok_s": ours, "llamacpp_tok_s": theirs, "ratio": statistics.median(ratios),
            "ratio_low": min(ratios), "ratio_high": max(ratios)}


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two sequences share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llamacpp", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads (and minillm's, with --compare)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16, help="requests of the chat workload")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens each decode round generates")
    parser.add_argument("--compare", action="store_true", help="also time minillm's float32 decode, same prompt")
    parser.add_argument("--paired", choices=["float32", "int8", "int4"], default=None,
                        help="only batch-1 decode: minillm in this format against llama.cpp, alternating rounds")
    parser.add_argument("--save", type=Path, default=None, help="with --paired: write its figures to this JSON file")
    args = parser.parse_args(argv)
    if not available():
        print(f"llama.cpp's Python bindings are not installed; to build them for this CPU:\n  {install_hint()}")
        return 1
    import llama_cpp

    print(f"llama.cpp (llama-cpp-python {llama_cpp.__version__}) on {default_gguf_path().name}, "
          f"{args.threads} thread(s); medians of {args.rounds} rounds")
    if args.paired:
        os.environ.setdefault(threads.ENV, str(args.threads))
        fmt = None if args.paired == "float32" else args.paired
        result = paired_decode(args.threads, chat_prompt(tokenizer()), args.new_tokens, args.rounds, fmt)
        for name, key in (("minillm " + result["format"], "minillm_tok_s"), ("llama.cpp Q4_1", "llamacpp_tok_s")):
            print(f"  {name:16} batch-1 decode tok/s by round: " + ", ".join(f"{x:.1f}" for x in result[key]))
        print(f"  minillm / llama.cpp: median {result['ratio']:.2f}x (rounds {result['ratio_low']:.2f}-"
              f"{result['ratio_high']:.2f}x)")
        if args.save:
            save_json(args.save, llama_cpp_python=llama_cpp.__version__, **result)
        return 0
    result = measure(args.threads, args.rounds, args.requests, args.new_tokens)
    row = "  {:38s} {:8.1f} {}".format
    print(row(f"decode, batch 1, {args.new_tokens} tokens", result["decode_tok_s"], "tok/s"))
    print(row("prefill, 384-token prompt", result["prefill_tok_s"], "tok/s"))
    print(row(f"chat, {args.requests} requests one at a time", result["chat_tok_s"], "output tok/s"))
    if args.compare:
        os.environ.setdefault(threads.ENV, str(args.threads))
        tok = tokenizer()
        prompt = chat_prompt(tok)
        ours, our_tokens = minillm_decode(prompt, args.new_tokens, args.rounds)
        theirs, _ = greedy(load(args.threads), prompt, args.new_tokens)
        same = agreeing_prefix(our_tokens, theirs)
        print(row("minillm float32 decode, batch 1", ours,
                  f"tok/s (llama.cpp / minillm = {result['decode_tok_s'] / ours:.2f}x)"))
        print(f"  greedy tokens agree for the first {same} of {args.new_tokens}"
              + (f"; then minillm {tok.decode(our_tokens[same:same + 1])!r}, llama.cpp "
                 f"{tok.decode(theirs[same:same + 1])!r}" if same < args.new_tokens else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
