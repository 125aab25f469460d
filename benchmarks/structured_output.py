"""Structured output on the default model (chapter 10): what a grammar costs each step, and what compiling one costs.

At batch 1 and 16, every sequence held to a JSON schema: the engine's decode step time, and within it the time
spent on the grammar's mask (`apply_masks`: llguidance fills each sequence's bitmask, which then sets the refused
logits to -inf), and the part of that in llguidance (`allowed_tokens`), measured in the same steps; the same prompts
decoded without a grammar give the plain step time.
The two runs alternate, `--rounds` times. Replaying each output through a fresh matcher times the grammar's work
per token alone (mask and advance). Also: building the tokenizer's llguidance view (once per engine), checking and
compiling a moderately sized schema and the largest one accepted, and finding one compiled again (a cache hit).
Run it on an otherwise idle machine:

    .venv/bin/python -m benchmarks.structured_output --threads 2 [--tokens 48] [--rounds 2] [--save FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minillm.model_runner
import minillm.sampling
from benchmarks.record import add_threads_option, save_json, use_threads
from minillm import LLM, SamplingParams
from minillm.bench import make_workload
from minillm.sampling import StructuredOutputsParams
from minillm.structured_output import MAX_GRAMMAR_CHARS, allowed_tokens
from minillm.workload import describe_machine

# a moderately sized schema (about 1.7 KB): an order with a customer, an address, a list of line items
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{6}$"},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 40}, "email": {"type": "string", "format": "email"},
            "vip": {"type": "boolean"}, "age": {"type": "integer", "minimum": 18, "maximum": 120}},
            "required": ["name", "email", "vip"], "additionalProperties": False},
        "address": {"type": "object", "properties": {
            "street": {"type": "string", "maxLength": 60}, "city": {"type": "string", "maxLength": 30},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "country": {"enum": ["FR", "DE", "IT", "ES", "UK", "US"]}},
            "required": ["street", "city", "zip", "country"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z0-9]{8}$"}, "quantity": {"type": "integer", "minimum": 1,
                                                                             "maximum": 99},
            "price": {"type": "number", "minimum": 0}, "gift": {"type": "boolean"}},
            "required": ["sku", "quantity", "price"], "additionalProperties": False}},
        "notes": {"type": ["string", "null"], "maxLength": 200},
        "created": {"type": "string", "format": "date-time"},
    },
    "required": ["order_id", "status", "customer", "address", "items", "created"],
    "additionalProperties": False,
}


def largest_schema(i: int) -> dict:
    """An object schema of many properties (strings with patterns, bounded integers, enums), just under
    `MAX_GRAMMAR_CHARS` as JSON; `i` makes each one new."""
    kinds = [{"type": "string", "pattern": "^[a-z]{2,8}$"}, {"type": "integer", "minimum": 0, "maximum": 999},
             {"enum": ["red", "green", "blue"]}, {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}]
    schema = {"type": "object", "description": f"run {i}", "properties": {}, "additionalProperties": False}
    while len(json.dumps(schema)) < MAX_GRAMMAR_CHARS - 100:
        n = len(schema["properties"])
        schema["properties"][f"field_{n}"] = kinds[n % len(kinds)]
    return schema


def median_ms(fn, repeats: int) -> float:
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run_steps(llm: LLM, prompts: list[list[int]], params: SamplingParams,
              timers: dict[str, list[float]]) -> tuple[list, list]:
    """Step the engine through the requests; (decode step seconds, batch size, and the seconds of each timer within
    the step) for the steps in which every sequence decodes, and the outputs."""
    engine = llm.engine
    llm.reset_prefix_cache()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", prompt, params)
    steps, outputs = [], []
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        decoding = not engine.num_waiting_seqs() and running and all(s.output_token_ids for s in running)
        for spent in timers.values():
            spent.clear()
        start = time.perf_counter()
        outs = engine.step()
        took = time.perf_counter() - start
        if decoding:
            steps.append((took, len(running), {name: sum(spent) for name, spent in timers.items()}))
        outputs += [o for o in outs if o.finished]
    return steps, outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.structured_output",
                                     description=__doc__.splitlines()[0])
    add_threads_option(parser)
    parser.add_argument("--tokens", type=int, default=48, help="tokens generated per request at most")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=5, help="compiles timed (median)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs with and without the schema")
    parser.add_argument("--save", "--json", dest="save", help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    use_threads(args)
    load = os.getloadavg()[0]
    llm = LLM()
    manager = llm.engine.structured_output
    print(describe_machine().replace("Ran on", "Machine") + f"; load average {load:.2f} at the start")

    start = time.perf_counter()
    manager.ll_tokenizer()
    tokenizer_ms = (time.perf_counter() - start) * 1e3
    specs: list[StructuredOutputsParams] = []
    check_ms = median_ms(lambda i: specs.append(StructuredOutputsParams(json={**ORDER, "description": f"run {i}"})),
                         args.repeats)
    compile_ms = median_ms(lambda i: manager.compile(specs[i]), args.repeats)
    hit_ms = median_ms(lambda i: manager.compile(specs[i]), args.repeats)
    size = len(specs[0].key[1])
    big: list[StructuredOutputsParams] = []
    big_check_ms = median_ms(lambda i: big.append(StructuredOutputsParams(json=largest_schema(i))), args.repeats)
    big_compile_ms = median_ms(lambda i: manager.compile(big[i]), args.repeats)
    print(f"\nllguidance's view of the tokenizer ({llm.engine.config.vocab_size} tokens), once per engine: "
          f"{tokenizer_ms:.0f} ms")
    print(f"a {size}-character schema (median of {args.repeats}): checked {check_ms:.2f} ms, compiled "
          f"{compile_ms:.2f} ms, found compiled {hit_ms * 1e3:.1f} us ({compile_ms / hit_ms:.0f}x less)")
    print(f"the largest accepted, {len(big[0].key[1])} characters ({len(big[0].json['properties'])} properties): "
          f"checked {big_check_ms:.1f} ms, compiled {big_compile_ms:.1f} ms")

    timers: dict[str, list[float]] = {"mask": [], "fill": []}

    def timed(fn, spent: list[float]):
        def run(*args):
            begin = time.perf_counter()
            out = fn(*args)
            spent.append(time.perf_counter() - begin)
            return out
        return run
    minillm.model_runner.apply_masks = timed(minillm.model_runner.apply_masks, timers["mask"])
    minillm.sampling.allowed_tokens = timed(minillm.sampling.allowed_tokens, timers["fill"])
    spec = StructuredOutputsParams(json=ORDER)
    prompts = [p for p, _ in make_workload("chat", max(args.batches), llm.get_tokenizer(), seed=3)]
    constrained = SamplingParams(max_tokens=args.tokens, structured_outputs=spec)
    free = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    run_steps(llm, prompts[:1], constrained, timers)  # warm-up
    print(f"\ngreedy, up to {args.tokens} tokens per request held to the schema; decode steps only (medians)")
    print(f"{'batch':>5} {'step (free)':>12} {'step (schema)':>14} {'mask/step':>10} {'llguidance':>11} "
          f"{'mask/token':>11} {'mask share':>11}")
    rows = []
    for batch in args.batches:
        steps, free_steps = [], []
        for _ in range(args.rounds):
            ran, outs = run_steps(llm, prompts[:batch], constrained, timers)
            steps += ran
            free_steps += run_steps(llm, prompts[:batch], free, timers)[0]
        full = [s for s in steps if s[1] == batch] or steps  # the steps while the whole batch still ran
        step = statistics.median(s[0] for s in full)
        mask = statistics.median(s[2]["mask"] for s in full)
        fill = statistics.median(s[2]["fill"] for s in full)
        plain = statistics.median(s[0] for s in free_steps if s[1] == batch)
        rows.append({"batch": batch, "step_free_ms": plain * 1e3, "step_schema_ms": step * 1e3,
                     "mask_ms": mask * 1e3, "llguidance_ms": fill * 1e3, "mask_share": mask / step,
                     "steps": len(full)})
        print(f"{batch:>5} {plain * 1e3:>10.1f}ms {step * 1e3:>12.1f}ms {mask * 1e3:>8.2f}ms {fill * 1e3:>9.2f}ms "
              f"{mask / batch * 1e6:>9.0f}us {mask / step:>10.1%}")
        if batch == min(args.batches):
            replay = outs
    per_token = []
    for out in replay:
        matcher = manager.compile(spec).matcher()
        for token in out.outputs[0].token_ids:
            begin = time.perf_counter()
            allowed_tokens([matcher], llm.engine.config.vocab_size)
            matcher.consume_token(token)
            per_token.append(time.perf_counter() - begin)
    grammar_us = statistics.median(per_token) * 1e6
    share = rows[0]["mask_share"]
    print(f"\nreplayed alone, the grammar's work per token (mask and advance): {grammar_us:.0f} us (median of "
          f"{len(per_token)} tokens)")
    print(f"target: mask at most 5 % of the step at batch {rows[0]['batch']}: {share:.1%}, "
          f"{'met' if share <= 0.05 else 'not met'}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    if args.save:
        save_json(args.save, threads=args.threads, tokens=args.tokens, tokenizer_ms=tokenizer_ms,
                  schema_chars=size, check_ms=check_ms, compile_ms=compile_ms, cache_hit_ms=hit_ms,
                  largest_check_ms=big_check_ms, largest_compile_ms=big_compile_ms, rows=rows,
                  grammar_us_per_token=grammar_us)
    return 0


if __name__ == "__main__":
    sys.exit(main())
