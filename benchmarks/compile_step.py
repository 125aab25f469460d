"""A quantized model's decode step on a CPU three ways, in one run: the modules of `model.py` layer by layer, the
same layer written in PyTorch operations around the C kernels and compiled by `torch.compile` (Inductor's CPU
backend), and the fused C step (`decode_step.c`).

For the compiled way, the C product kernel, the cache store and the C attention kernel are registered as custom
operators (`torch.library.custom_op`), opaque to the compiler; everything between them (RMSNorm, RoPE, SiLU times
up, the reshapes) is PyTorch that Inductor fuses into generated C++ loops. One graph serves every layer (the
weights are its inputs). The three ways run the same engine's layers on the same captured decode step (its
hidden states, positions, slots and block tables), alternating round by round; reported: the median ms per step,
compile time, and how far each way's last-layer output is from the modules' (the compiled one rounds its small
operations in Inductor's order, so it is close, not equal).

    .venv/bin/python -m benchmarks.compile_step [--format int4] [--batch 1] [--rounds 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm import LLM, SamplingParams, threads
from minillm.kernels.cpu import paged_decode_unchecked
from minillm.kernels.int4_cpu import Int4Weight, Int8Weight, matmul_unchecked


@torch.library.custom_op("minillm_bench::product", mutates_args=())
def product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int, n: int,
            residual: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ residual) by the C product kernel, W in its int4 (with `zero`) or int8 layout."""
    k = x.shape[1]
    w = Int4Weight(q, scale, zero, group, n, k) if zero is not None else Int8Weight(q, scale, group, n, k)
    return matmul_unchecked(x.contiguous(), w, residual, torch.empty(x.shape[0], n))


@product.register_fake
def _(x, q, scale, zero, group, n, residual):
    return x.new_empty(x.shape[0], n)


@torch.library.custom_op("minillm_bench::store", mutates_args=("k_cache", "v_cache"))
def store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Keys and values of the new tokens into their cache slots."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)


@torch.library.custom_op("minillm_bench::attention", mutates_args=())
def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
              lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence over the paged cache, by the C attention kernel."""
    return paged_decode_unchecked(q.contiguous(), k_cache, v_cache, tables, lens, scale)


@attention.register_fake
def _(q, k_cache, v_cache, tables, lens, scale):
    return q.new_empty(q.shape)


def weight_args(p) -> tuple:
    """A quantized projection's tensors and sizes, as `product` takes them."""
    w = p.kernel
    return w.q, w.scale, getattr(w, "zero", None), w.group_size, w.out_features


def layer_step(x, cos, sin_signed, qkv, o, gate_up, down, norm1, norm2, k_cache, v_cache, slots, tables, lens,
               heads: int, kv_heads: int, eps: float):
    """One decoder layer's decode step in PyTorch operations around the C kernels (the arithmetic of model.py)."""
    d = cos.shape[-1]

    def norm(h, gain):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * gain

    hs = product(norm(x, norm1), *qkv, None).view(x.shape[0], heads + 2 * kv_heads, d)
    qk = hs[:, :heads + kv_heads]
    qk = qk * cos + qk.roll(d // 2, dims=-1) * sin_signed
    q, k, v = qk[:, :heads], qk[:, heads:], hs[:, heads + kv_heads:]
    store(k, v, k_cache, v_cache, slots)
    att = attention(q, k_cache, v_cache, tables, lens, d ** -0.5)
    x = product(att.flatten(1), *o, x)
    gu = product(norm(x, norm2), *gate_up, None)
    inter = gu.shape[1] // 2
    return product(F.silu(gu[:, :inter]) * gu[:, inter:], *down, x)


def capture_decode_step(llm: LLM, batch: int, context: int) -> tuple:
    """(x, positions, kv_cache, meta) of the first decode step of `batch` requests with `context`-token prompts."""
    model, seen = llm.engine.model, []
    run_layers = model.run_layers

    def capture(x, positions, kv_cache, meta):
        if meta.prefill is None and not seen:
            seen.append((x.clone(), positions, kv_cache, meta))
        return run_layers(x, positions, kv_cache, meta)

    model.run_layers = capture
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (context,), generator=gen).tolist() for _ in range(batch)]
    try:
        llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    finally:
        del model.run_layers
    return seen[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_step", description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="int4", choices=["int4", "int8"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="steps per way and round")
    parser.add_argument("--threads", type=int, default=1,
                        help="PyTorch CPU threads (default 1; 0 = the engine's default)")
    args = parser.parse_args(argv)
    if args.threads:
        os.environ[threads.ENV] = str(args.threads)  # the engine sets it when built
    llm = LLM(quantization=args.format, quantization_group_size=32, enable_prefix_caching=False,
              max_num_seqs=args.batch)
    model = llm.engine.model
    x0, positions, kv_cache, meta = capture_decode_step(llm, args.batch, args.context)
    fused = model.fused_decode(kv_cache)
    if fused is None:
        print("no fused step here: it needs the C kernels on a CPU and a float32 cache")
        return 1
    attn, eps = model.layers[0].self_attn, model.config.rms_norm_eps
    layers = [(weight_args(L.self_attn.qkv_proj), weight_args(L.self_attn.o_proj), weight_args(L.mlp.gate_up_proj),
               weight_args(L.mlp.down_proj), L.input_layernorm.weight.detach(),
               L.post_attention_layernorm.weight.detach(), *kv_cache.layer(i)[:2]) for i, L in enumerate(model.layers)]
    cos, sin_signed = model.rotary.cos_sin(positions, torch.float32)
    compiled = torch.compile(layer_step, dynamic=False, fullgraph=True)

    def run_compiled(x):
        for w in layers:
            x = compiled(x, cos, sin_signed, *w, meta.slot_mapping, meta.block_tables, meta.context_lens,
                         attn.num_heads, attn.num_kv_heads, eps)
        return x

    def run_modules(x):
        model.use_fused_step = False
        try:
            return model.run_layers(x, positions, kv_cache, meta)
        finally:
            model.use_fused_step = True

    def run_fused(x):
        return model.run_layers(x, positions, kv_cache, meta)

    with torch.inference_mode():
        start = time.perf_counter()
        out = {"compiled": run_compiled(x0.clone())}
        compile_s = time.perf_counter() - start
        out |= {"modules": run_modules(x0.clone()), "fused": run_fused(x0.clone())}
        ways = {"modules": run_modules, "compiled": run_compiled, "fused": run_fused}
        ms = {name: [] for name in ways}
        for r in range(args.rounds):
            for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                times = []
                for _ in range(args.steps):
                    x = x0.clone()
                    begin = time.perf_counter()
                    ways[name](x)
                    times.append(time.perf_counter() - begin)
                ms[name].append(1e3 * statistics.median(times))
    ref = out["modules"]
    print(f"{torch.get_num_threads()} threads; {args.format} (groups of 32), batch {args.batch}, context "
          f"{args.context}; {args.rounds} rounds of {args.steps} steps per way, alternating; torch "
          f"{torch.__version__}; compiling took {compile_s:.1f} s")
    print(f"{'way':>9} {'ms per step':>11} {'(min-max of rounds)':>20} {'vs modules':>10} "
          f"{'max |diff| / max |x|':>21}")
    base = statistics.median(ms["modules"])
    for name in ways:
        med = statistics.median(ms[name])
        diff = float((out[name] - ref).abs().max() / ref.abs().max())
        print(f"{name:>9} {med:11.2f} {min(ms[name]):9.2f}-{max(ms[name]):<10.2f} {base / med:9.2f}x {diff:21.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
