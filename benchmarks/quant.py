"""Quantized minillm against its float32 engine and against llama.cpp on the same GGUF, in one run.

Three parts (`--parts`, default all):
  products  every weight product of one decode step (30 layers + head) in float32 (the engine's oneDNN path),
            int8 and int4, each with float32 and bfloat16 activations: why the quantized paths take bf16;
  engine    the engine per format (float32, int8 per channel and G=32, int4 G=32): batch-1 decode tok/s, a 384-token prefill, and
            the chat workload of benchmarks/throughput.py (16 requests at once); llama.cpp on the default
            model's own GGUF (Q4_1) runs the same prompts when llama-cpp-python is installed
            (`benchmarks/llamacpp.py` says how), and the targets are printed as ratios;
  quality   perplexity of the shipped text (`minillm.perplexity`) and greedy agreement with float32 on the
            parity prompts, for every weight format and KV cache format.

    .venv/bin/python -m benchmarks.quant [--parts products engine quality] [--rounds 3] [--threads 1]
                                         [--ppl-tokens N] [--requests 16] [--save engine.json]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import llamacpp
from benchmarks.record import add_threads_option, save_json, use_threads
from minillm import LLM, SamplingParams, quant, quant_formats
from minillm.bench import corpus_ids, make_workload, run_minillm
from minillm.metrics import tpot
from minillm.perplexity import greedy_agreement, perplexity
from minillm.roofline import decode_linears, time_median

FORMATS = {"float32": {}, "int8": dict(quantization="int8"),
           "int8 G=32": dict(quantization="int8", quantization_group_size=32),
           "int4 G=32": dict(quantization="int4", quantization_group_size=32)}
QUALITY = {**FORMATS, "int4 G=64": dict(quantization="int4", quantization_group_size=64),
           "fp8": dict(quantization="fp8"), "KV cache int8": dict(kv_cache_dtype="int8"),
           "KV cache fp8": dict(kv_cache_dtype="fp8")}
PARITY_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
                  "Once upon a time, in a small village by the sea,",
                  "Les grands modèles de langage génèrent du texte", "大模型推理的两个阶段是"]
PARITY_CHATS = ["What is a KV cache? Answer in one sentence.", "List three prime numbers."]


def step_products(model, batch: int, group_size: int) -> dict[str, object]:
    """name -> a function running every product of one decode step in that format."""
    linears = decode_linears(model)
    weights = [lin.weight.detach() for lin in linears] + [model.embed_tokens.weight.detach()]
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}
    int8 = [quant_formats.quantize_int8(w) for w in weights]
    int4 = [(quant.to_int4pack(*quant_formats.quantize_int4(w, group_size))) for w in weights]

    def fp32():
        for lin in linears:
            lin.forward(inputs[lin.in_features])
        model.logits(inputs[model.config.hidden_size])

    def int8_step(dtype):
        xs = {k: v.to(dtype) for k, v in inputs.items()}
        return lambda: [quant.int8_linear(xs[w.shape[1]], q, s) for w, (q, s) in zip(weights, int8)]

    def int4_step(dtype):
        xs = {k: v.to(dtype) for k, v in inputs.items()}
        return lambda: [quant.int4_linear(xs[w.shape[1]], p, sz, group_size) for w, (p, sz) in zip(weights, int4)]

    return {"float32 (oneDNN packed)": fp32, "int8, fp32 activations": int8_step(torch.float32),
            "int8, bf16 activations": int8_step(torch.bfloat16), "int4, fp32 activations": int4_step(torch.float32),
            "int4, bf16 activations": int4_step(torch.bfloat16)}


def products(llm: LLM, batches: list[int], rounds: int, group_size: int) -> None:
    print(f"\n== products: ms per decode step's products (30 layers + head), int4 G={group_size}, "
          f"median of {rounds} rounds")
    with torch.inference_mode():
        for batch in batches:
            variants = step_products(llm.engine.model, batch, group_size)
            times: dict[str, list[float]] = {name: [] for name in variants}
            for fn in variants.values():
                fn()  # warm-up
            for _ in range(rounds):
                for name, fn in variants.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            base = statistics.median(times["float32 (oneDNN packed)"])
            print(f"batch {batch}:")
            for name, t in times.items():
                print(f"  {name:26} {1e3 * statistics.median(t):8.1f} ms   {base / statistics.median(t):5.2f}x")


def engine_figures(llm: LLM, prompt: list[int], long_prompt: list[int], work, rounds: int) -> dict[str, float]:
    """Batch-1 decode tok/s (1 / time per output token of 128 greedy tokens), prefill tok/s of `long_prompt`,
    and output tok/s of the chat workload `work` submitted at once; medians over rounds."""
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    decode = statistics.median(1 / tpot(llm.generate([prompt], params, use_tqdm=False)[0].metrics)
                               for _ in range(rounds))
    prefill = len(long_prompt) / time_median(lambda: llm.engine.next_token_logits(long_prompt), llm.engine.device,
                                             repeats=rounds, warmup=1)
    chat = run_minillm(llm, work)
    return {"decode_tok_s": decode, "prefill_tok_s": prefill, "chat_tok_s": chat["output_tokens"] / chat["seconds"]}


def engine(rounds: int, requests: int, save: Path | None = None) -> None:
    """The engine part (see the module's docstring); `save`: also write its figures there as JSON."""
    tok = llamacpp.tokenizer()
    prompt, long_prompt = llamacpp.chat_prompt(tok), corpus_ids(tok)[:384]
    work = make_workload("chat", requests, tok)
    results = {}
    for name, kwargs in FORMATS.items():
        llm = LLM(enable_prefix_caching=False, **kwargs)
        results[f"minillm {name}"] = engine_figures(llm, prompt, long_prompt, work, rounds)
        del llm
        gc.collect()
    if llamacpp.available():
        ll = llamacpp.load(torch.get_num_threads())
        results["llama.cpp Q4_1 (one request at a time)"] = {
            "decode_tok_s": llamacpp.decode_tok_s(ll, prompt, 128, rounds),
            "prefill_tok_s": llamacpp.prefill_tok_s(ll, long_prompt, rounds),
            "chat_tok_s": llamacpp.chat_tok_s(ll, tok, requests, 1)["tok_s"]}
    else:
        print(f"llama.cpp is not installed, so it is not measured; to build it for this CPU:\n  "
              f"{llamacpp.install_hint()}")
    print(f"\n== engine: {torch.get_num_threads()} thread(s); decode = batch 1, 128 tokens; prefill = 384 tokens; "
          f"chat = {requests} requests of benchmarks/throughput.py's chat workload")
    print(f"  {'':40} {'decode tok/s':>12} {'prefill tok/s':>13} {'chat tok/s':>10}")
    for name, r in results.items():
        print(f"  {name:40} {r['decode_tok_s']:12.1f} {r['prefill_tok_s']:13.1f} {r['chat_tok_s']:10.1f}")
    fp32, int8, _, int4 = (results[f"minillm {n}"] for n in FORMATS)
    print(f"  target int8 decode >= 2x float32:                 {int8['decode_tok_s'] / fp32['decode_tok_s']:.2f}x")
    lc = results.get("llama.cpp Q4_1 (one request at a time)")
    if lc:
        print(f"  target int4 decode >= 2x llama.cpp Q4_1 decode:   {int4['decode_tok_s'] / lc['decode_tok_s']:.2f}x")
        print(f"  target int4 chat ({requests} at once) >= 3x llama.cpp: {int4['chat_tok_s'] / lc['chat_tok_s']:.2f}x")
    if save:
        save_json(save, threads=torch.get_num_threads(), rounds=rounds, requests=requests, results=results)


def quality(ppl_tokens: int | None) -> None:
    base = LLM(enable_prefix_caching=False)
    tok = base.get_tokenizer()
    prompts = [tok(p).input_ids for p in PARITY_PROMPTS] + [base.engine.apply_chat_template(
        [{"role": "user", "content": c}]) for c in PARITY_CHATS]
    reference = [o.outputs[0].token_ids for o in
                 base.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)]
    del base
    rows = {}
    for name, kwargs in QUALITY.items():
        llm = LLM(enable_prefix_caching=False, **kwargs)
        rows[name] = (perplexity(llm, max_tokens=ppl_tokens), greedy_agreement(llm, prompts, reference))
        del llm
        gc.collect()
    base_ppl = rows["float32"][0].perplexity
    print(f"\n== quality: perplexity of {rows['float32'][0].num_tokens + 1} tokens of the shipped text (window "
          f"1024, stride 512); greedy agreement with float32 on {len(prompts)} prompts x 32 tokens")
    print(f"  {'':16} {'perplexity':>10} {'vs float32':>10} {'identical':>9} {'mean tokens before split':>24} "
          f"{'top-1 agreement':>15}")
    for name, (ppl, agree) in rows.items():
        before = statistics.mean(32 if n < 0 else n for n in agree.prefix_tokens)
        print(f"  {name:16} {ppl.perplexity:10.3f} {100 * (ppl.perplexity / base_ppl - 1):+9.2f}% "
              f"{agree.identical:>5}/{len(prompts)} {before:24.1f} {agree.top1:15.1%}")
    print(f"  targets: int8 <= +1 %: per output channel {100 * (rows['int8'][0].perplexity / base_ppl - 1):+.2f} %, "
          f"in groups of 32 {100 * (rows['int8 G=32'][0].perplexity / base_ppl - 1):+.2f} %; "
          f"int4 G=32 <= +2 %: {100 * (rows['int4 G=32'][0].perplexity / base_ppl - 1):+.2f} %")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quant", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=["products", "engine", "quality"],
                        default=["products", "engine", "quality"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="batch sizes of the products part")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=64, help="int4 group size of the products part")
    parser.add_argument("--requests", type=int, default=16, help="requests of the chat workload")
    parser.add_argument("--ppl-tokens", type=int, default=None, help="score only the text's first N tokens")
    add_threads_option(parser)
    parser.add_argument("--save", type=Path, default=None, help="write the engine part's figures to this JSON file")
    args = parser.parse_args(argv)
    use_threads(args)
    if "products" in args.parts:
        llm = LLM(enable_prefix_caching=False, num_kv_blocks=16)
        print(f"{llm.engine.device}, {torch.get_num_threads()} thread(s)")
        products(llm, args.batches, args.rounds, args.group_size)
        del llm
    if "engine" in args.parts:
        engine(args.rounds, args.requests, args.save)
    if "quality" in args.parts:
        quality(args.ppl_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
