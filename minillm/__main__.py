"""Chapter 8 — the command line: `python -m minillm generate "prompt"` streams a reply to the terminal,
`serve` starts the OpenAI-compatible server, and `bench` benchmarks one (or, with `--offline`, an engine in
this process). Every engine flag comes from `EngineArgs`, so the three take the same ones. The command line
runs PyTorch's OpenMP threads with `OMP_WAIT_POLICY=PASSIVE` unless that is set (chapter 4: sleeping rather than
spinning threads let an engine use every core without stalling when another process wants one)."""

from __future__ import annotations

import argparse
import os
import sys

if "torch" not in sys.modules:  # OpenMP reads its wait policy once, when PyTorch loads: choose it first
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # sleeping threads; the engine then takes every core

from . import bench  # noqa: E402 (after the policy)
from .engine_args import EngineArgs  # noqa: E402
from .llm import LLM  # noqa: E402
from .sampling import RequestOutputKind, SamplingParams  # noqa: E402
from .serving.launch import add_arguments as add_serve_arguments, serve  # noqa: E402


def generate(args: argparse.Namespace) -> None:
    llm = LLM(EngineArgs.from_cli_args(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, output_kind=RequestOutputKind.DELTA)
    prompt = args.prompt if args.raw else llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    out = None
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.outputs[0].text)  # only the new text; a half character is held back until whole
        sys.stdout.flush()
    m = out.metrics
    n = m.output_tokens
    decode = (m.finished_time - m.first_token_time) / max(n - 1, 1)
    print(f"\n[{n} tokens, finish={out.outputs[0].finish_reason}, TTFT {1000 * (m.first_token_time - m.arrival_time):.0f} ms, "
          f"{1 / decode if n > 1 else 0:.1f} tokens/s decode]", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    """The command line: `generate`, `serve` and `bench`, each with every `EngineArgs` flag."""
    parser = argparse.ArgumentParser(prog="python -m minillm", description=__doc__.partition(" — ")[2])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a reply to one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="use the prompt as plain text, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    EngineArgs.add_cli_args(gen)
    add_serve_arguments(sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API"))
    bench.add_arguments(sub.add_parser("bench", help="benchmark an OpenAI-compatible server",
                                       description=bench.DESCRIPTION))
    return parser


def main(argv: list[str] | None = None) -> int | None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return {"generate": generate, "serve": serve, "bench": bench.run}[args.command](args)
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
