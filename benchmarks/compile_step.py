"""A quantized model's decode step on a CPU four ways, in one run: the modules of `model.py` layer by layer, the
same layer written in PyTorch operations around the C kernels and compiled by `torch.compile` (Inductor's CPU
backend) with those kernels as Python or as C++ custom operators, and the fused C step (`decode_step.c`).

For the compiled ways the C product kernel, the cache store and the C attention kernel are custom operators,
opaque to the compiler; everything between them (RMSNorm, RoPE, SiLU times up, the reshapes) is PyTorch that
Inductor fuses into generated C++ loops. Python operators (`torch.library.custom_op`) are what one writes first;
C++ ones (`compile_step_ops.cpp`, built here with the machine's C++ compiler against PyTorch's headers) take
Python out of each kernel call, and Inductor's `cpp_wrapper` option also generates the code that calls the
kernels in C++ instead of Python. One graph serves every layer (the weights are its inputs). All ways run the same
engine's layers on the same captured decode step (its hidden states, positions, slots and block tables),
alternating round by round; reported: the median ms per step, compile time, and how far each way's last-layer
output is from the modules' (the compiled ways round their small operations in Inductor's order: close, not equal).

    .venv/bin/python -m benchmarks.compile_step [--format int4] [--batch 1] [--rounds 7] [--threads 1]
                                                [--save benchmarks/results/compile_step_1.json]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import add_threads_option, save_json, use_threads
from minillm import LLM, SamplingParams
from minillm.kernels import cpu, int4_cpu
from minillm.kernels.cpu import paged_decode_unchecked
from minillm.kernels.int4_cpu import Int4Weight, Int8Weight, matmul_unchecked

CPP_SOURCE = Path(__file__).with_name("compile_step_ops.cpp")


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


def cpp_ops() -> SimpleNamespace | None:
    """The C++ operators of `compile_step_ops.cpp`, built (once, cached) and pointed at minillm's kernels; None
    when no C++ compiler builds them here."""
    library = cpu.build_torch_library(CPP_SOURCE)
    if library is None:
        print("the C++ operators did not build here; skipping them")
        return None
    torch.ops.load_library(str(library))
    address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
    torch.ops.minillm_cpp.set_kernels(address(int4_cpu._require().quant_matmul_f32),
                                      address(cpu._library().paged_decode_f32))
    torch.library.register_fake("minillm_cpp::product")(lambda x, q, scale, zero, group, n, residual:
                                                         x.new_empty(x.shape[0], n))
    torch.library.register_fake("minillm_cpp::attention")(lambda q, k_cache, v_cache, tables, lens, scale:
                                                           q.new_empty(q.shape))
    ops = torch.ops.minillm_cpp
    return SimpleNamespace(product=ops.product, store=ops.store, attention=ops.attention)


PYTHON_OPS = SimpleNamespace(product=product, store=store, attention=attention)


def weight_args(p) -> tuple:
    """A quantized projection's tensors and sizes, as `product` takes them."""
    w = p.kernel
    return w.q, w.scale, getattr(w, "zero", None), w.group_size, w.out_features


def layer_step(ops: SimpleNamespace):
    """One decoder layer's decode step in PyTorch operations around the C kernels `ops` (model.py's arithmetic)."""

    def step(x, cos, sin_signed, qkv, o, gate_up, down, norm1, norm2, k_cache, v_cache, slots, tables, lens,
             heads: int, kv_heads: int, eps: float):
        d = cos.shape[-1]

        def norm(h, gain):
            return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * gain

        hs = ops.product(norm(x, norm1), *qkv, None).view(x.shape[0], heads + 2 * kv_heads, d)
        qk = hs[:, :heads + kv_heads]
        qk = qk * cos + qk.roll(d // 2, dims=-1) * sin_signed
        q, k, v = qk[:, :heads], qk[:, heads:], hs[:, heads + kv_heads:]
        ops.store(k, v, k_cache, v_cache, slots)
        att = ops.attention(q, k_cache, v_cache, tables, lens, d ** -0.5)
        x = ops.product(att.flatten(1), *o, x)
        gu = ops.product(norm(x, norm2), *gate_up, None)
        inter = gu.shape[1] // 2
        return ops.product(F.silu(gu[:, :inter]) * gu[:, inter:], *down, x)

    return step


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
    add_threads_option(parser)
    parser.add_argument("--save", type=Path, default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    use_threads(args)
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

    def compiled_way(ops: SimpleNamespace, cpp_wrapper: bool = False):
        compiled = torch.compile(layer_step(ops), dynamic=False, fullgraph=True,
                                 options={"cpp_wrapper": cpp_wrapper})

        def run(x):
            for w in layers:
                x = compiled(x, cos, sin_signed, *w, meta.slot_mapping, meta.block_tables, meta.context_lens,
                             attn.num_heads, attn.num_kv_heads, eps)
            return x
        return run

    def run_modules(x):
        model.use_fused_step = False
        try:
            return model.run_layers(x, positions, kv_cache, meta)
        finally:
            model.use_fused_step = True

    def run_fused(x):
        return model.run_layers(x, positions, kv_cache, meta)

    ways = {"modules": run_modules, "compiled, Python ops": compiled_way(PYTHON_OPS)}
    if (native := cpp_ops()) is not None:
        ways["compiled, C++ ops"] = compiled_way(native)
        ways["C++ ops, C++ wrapper"] = compiled_way(native, cpp_wrapper=True)
    ways["fused"] = run_fused
    with torch.inference_mode():
        out, compile_s = {}, {}
        for name, way in ways.items():  # the first call of a compiled way compiles it
            start = time.perf_counter()
            out[name] = way(x0.clone())
            compile_s[name] = time.perf_counter() - start
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
          f"{args.context}; {args.rounds} rounds of {args.steps} steps per way, alternating; torch {torch.__version__}")
    print(f"{'way':>21} {'ms per step':>11} {'rounds min-max':>15} {'vs modules':>10} {'first call s':>12} "
          f"{'max |diff| / max |x|':>21}")
    base = statistics.median(ms["modules"])
    rows = {}
    for name in ways:
        med = statistics.median(ms[name])
        diff = float((out[name] - ref).abs().max() / ref.abs().max())
        rows[name] = {"ms": med, "ms_rounds": ms[name], "first_call_s": compile_s[name], "max_rel_diff": diff}
        print(f"{name:>21} {med:11.2f} {min(ms[name]):7.2f}-{max(ms[name]):<7.2f} {base / med:9.2f}x "
              f"{compile_s[name]:12.1f} {diff:21.2e}")
    print("first call: compiling, or loading what Inductor compiled before from its cache on disk")
    if args.save:
        save_json(args.save, threads=torch.get_num_threads(), torch=torch.__version__, format=args.format,
                  batch=args.batch, context=args.context, rounds=args.rounds, steps=args.steps, ways=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
