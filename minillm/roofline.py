"""Chapter 2 — roofline accounting: the FLOPs and bytes of every layer of a Llama-family forward pass, and this
machine's roofs.

Prefill and decode run the same layers; what differs is how many tokens share each read of the weights.
`prefill_costs` and `decode_costs` count both, op by op; `measure_bandwidth` and `measure_matmul_flops`
measure the machine's two roofs (bytes/s and FLOP/s), whose ratio, the ridge point, splits memory-bound
work from compute-bound work; `measure_cache_bandwidth` and `cpu_cache_sizes` place the caches above the
memory (chapter 3's memory hierarchy). Chapter 6 adds a third roof, `measure_int8_peak`: the rate of the 8-bit
multiply-adds its quantized kernels run on, which bounds a batched quantized step as the bandwidth bounds one
at batch 1.

Conventions: a multiply-add is 2 FLOPs (as `torch.utils.flop_counter` counts matmuls); softmax, RMSNorm,
RoPE and SwiGLU are counted at a few FLOPs per element (stated at each op); bytes are the ideal traffic,
every tensor read or written once (weights once per forward pass, whatever the number of tokens).
"""

from __future__ import annotations

import ctypes
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import ModelConfig

# Bytes per parameter of the weight formats in the memory-budget table (int4 without its group scales).
WEIGHT_FORMATS: dict[str, float] = {"fp32": 4, "bf16": 2, "int8": 1, "int4": 0.5}

# Llama-2-7B's shape (meta-llama/Llama-2-7b-hf config.json): the "7B" of the memory table.
LLAMA2_7B = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                        num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                        max_position_embeddings=4096, tie_word_embeddings=False)


@dataclass(frozen=True)
class OpCost:
    """FLOPs and bytes moved by one op of the forward pass; ops inside a block run `repeat` (= num_layers) times."""

    name: str
    flops: float
    weight_bytes: float  # parameters read
    act_bytes: float     # activations read and written
    kv_bytes: float = 0  # keys and values read from or written to the KV cache
    repeat: int = 1

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.act_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte moved (the same for one run of the op or all `repeat`)."""
        return self.flops / self.bytes


def forward_costs(config: ModelConfig, query_lens: Sequence[int], context_lens: Sequence[int],
                  dtype_bytes: float = 2, weight_bytes: float | None = None) -> list[OpCost]:
    """Every op of one forward pass over a batch: sequence s brings `query_lens[s]` new tokens and attends to
    `context_lens[s]` tokens in all (cached + new), as in `AttentionMetadata`. Logits are computed for the
    last new token of each sequence only. `dtype_bytes` sizes activations and the KV cache, `weight_bytes`
    the parameters (default: `dtype_bytes`)."""
    if len(query_lens) != len(context_lens) or not query_lens:
        raise ValueError("give one query length and one context length per sequence (at least one sequence)")
    if any(q < 1 or c < q for q, c in zip(query_lens, context_lens)):
        raise ValueError(f"need 1 <= query_len <= context_len per sequence, got {list(zip(query_lens, context_lens))}")
    c, a = config, dtype_bytes
    w = dtype_bytes if weight_bytes is None else weight_bytes
    h, heads, d, i, v = c.hidden_size, c.num_heads, c.head_dim, c.intermediate_size, c.vocab_size
    q_size, kv_size, qkv = heads * d, c.num_kv_heads * d, (heads + 2 * c.num_kv_heads) * d
    t, seqs, layers = sum(query_lens), len(query_lens), c.num_layers
    # (query, key) pairs: new token j of a sequence sits at position ctx - qlen + j and sees keys 0..that (causal)
    pairs = sum(q * (ctx - q) + q * (q + 1) // 2 for q, ctx in zip(query_lens, context_lens))
    keys_read = sum(context_lens)  # each sequence's cached keys (and values) read once, shared by its GQA group
    qkv_bias = qkv if c.qkv_bias else 0

    def linear(name: str, rows: int, n_in: int, n_out: int, bias: int = 0) -> OpCost:
        return OpCost(name, 2 * rows * n_in * n_out + rows * bias, w * (n_in * n_out + bias),
                      a * rows * (n_in + n_out), repeat=layers)

    return [
        OpCost("embed_tokens", 0, w * min(t, v) * h, a * t * h),  # a gather: reads only the rows of the tokens
        OpCost("rms_norm x2", 2 * 4 * t * h, 2 * w * h, 2 * a * 2 * t * h, repeat=layers),  # square, mean, 2 scales
        linear("qkv_proj", t, h, qkv, qkv_bias),
        OpCost("rope", 3 * t * (q_size + kv_size), 0, a * 2 * t * (q_size + kv_size), repeat=layers),  # 2 mul + add
        OpCost("store_kv", 0, 0, a * t * 2 * kv_size, a * t * 2 * kv_size, repeat=layers),
        OpCost("attn_scores", (2 * d + 5) * heads * pairs, 0, a * t * q_size, a * keys_read * kv_size,
               repeat=layers),  # q.k, then scale, max, exp, sum, divide: 5 per score
        OpCost("attn_values", 2 * d * heads * pairs, 0, a * t * q_size, a * keys_read * kv_size, repeat=layers),
        linear("o_proj", t, q_size, h),
        OpCost("residual x2", 2 * t * h, 0, 2 * a * 3 * t * h, repeat=layers),
        linear("gate_up_proj", t, h, 2 * i),
        OpCost("silu_and_mul", 5 * t * i, 0, a * 3 * t * i, repeat=layers),  # silu ~4 (exp, add, div, mul) + mul
        linear("down_proj", t, i, h),
        OpCost("final_norm", 4 * t * h, w * h, a * 2 * t * h),
        OpCost("lm_head", 2 * seqs * h * v, w * h * v, a * seqs * (h + v)),
    ]


def prefill_costs(config: ModelConfig, num_tokens: int, dtype_bytes: float = 2, num_seqs: int = 1,
                  weight_bytes: float | None = None) -> list[OpCost]:
    """Prefill of `num_seqs` fresh prompts of `num_tokens` tokens each (nothing cached before)."""
    return forward_costs(config, [num_tokens] * num_seqs, [num_tokens] * num_seqs, dtype_bytes, weight_bytes)


def decode_costs(config: ModelConfig, batch: int, context_len: int, dtype_bytes: float = 2,
                 weight_bytes: float | None = None) -> list[OpCost]:
    """One decode step: `batch` sequences, one new token each, attending to `context_len` tokens (new one included)."""
    return forward_costs(config, [1] * batch, [context_len] * batch, dtype_bytes, weight_bytes)


def total_flops(ops: Sequence[OpCost]) -> float:
    return sum(op.flops * op.repeat for op in ops)


def total_bytes(ops: Sequence[OpCost]) -> float:
    return sum(op.bytes * op.repeat for op in ops)


def arithmetic_intensity(ops: Sequence[OpCost]) -> float:
    """FLOPs per byte of the whole pass: where it sits on the roofline's x axis."""
    return total_flops(ops) / total_bytes(ops)


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """The intensity (FLOP/byte) where the two roofs meet: below it memory bounds the speed, above it compute."""
    return peak_flops / bandwidth


def attainable_flops(intensity, peak_flops: float, bandwidth: float):
    """The roofline itself: min(peak FLOP/s, intensity x bandwidth), for a number or a numpy array."""
    return np.minimum(peak_flops, np.asarray(intensity, dtype=float) * bandwidth)


# ---- measuring this machine -------------------------------------------------------------------------------


def _default_device(device) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def time_median(fn: Callable[[], object], device: torch.device | str = "cpu", repeats: int = 10,
                warmup: int = 3) -> float:
    """Median wall time of `fn()` in seconds, after `warmup` untimed calls (GPU work waited for)."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_interleaved(fns: Sequence[Callable[[], object]], device: torch.device | str = "cpu", repeats: int = 10,
                     warmup: int = 2) -> list[list[float]]:
    """Wall times in seconds of each of `fns`, `repeats` calls each, called in turn (the order rotating every
    repeat), so that every function sees the same machine: a slow spell slows all of them, not one."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        for fn in fns:
            fn()
    times, order = [[] for _ in fns], list(range(len(fns)))
    for r in range(repeats):
        shift = r % len(fns)
        for i in order[shift:] + order[:shift]:
            sync()
            start = time.perf_counter()
            fns[i]()
            sync()
            times[i].append(time.perf_counter() - start)
    return times


def measure_bandwidth(kind: str = "triad", nbytes: int | None = None, device=None, repeats: int = 10) -> float:
    """Memory bandwidth in bytes/s from a STREAM-like kernel on arrays of `nbytes` each, by default far beyond any
    cache: 1 GiB on a GPU; on a CPU four times its largest cache (`cpu_cache_sizes`), at least 128 MiB, since a
    server's last-level cache can hold hundreds of megabytes and a smaller array would time the cache.

    "copy": a = b (reads b, writes a); "triad": a = b + s*c (reads b and c, writes a); "read": sum(b).
    """
    arrays = {"copy": 2, "triad": 3, "read": 1}
    if kind not in arrays:
        raise ValueError(f"kind {kind!r} is not a bandwidth kernel; use one of {sorted(arrays)}")
    device = _default_device(device)
    if nbytes is None:
        nbytes = 1 << 30 if device.type == "cuda" else max(1 << 27, 4 * max(cpu_cache_sizes().values(), default=0))
    n = nbytes // 4
    b, a, c = [torch.full((n,), 1.0, device=device) for _ in range(arrays[kind])] + [None] * (3 - arrays[kind])
    fn = {"copy": lambda: a.copy_(b), "triad": lambda: torch.add(b, c, alpha=3.0, out=a), "read": lambda: b.sum()}
    return arrays[kind] * n * 4 / time_median(fn[kind], device, repeats)


def measure_cache_bandwidth(nbytes: int, device=None, read_bytes: int = 1 << 26, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s of a working set of `nbytes`, summed over `read_bytes` in all: a stride-0 view
    rereads the same array, so it stays in whichever cache level holds it (beyond every cache, memory's rate)."""
    if nbytes < 4:
        raise ValueError(f"a working set needs at least one float32 (4 bytes), got {nbytes} bytes")
    device = _default_device(device)
    n, passes = nbytes // 4, max(1, read_bytes // nbytes)
    rereads = torch.rand(n, device=device).expand(passes, n)  # passes x n elements, n of them in memory
    return passes * n * 4 / time_median(lambda: rereads.sum(), device, repeats)


def cpu_cache_sizes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> dict[str, int]:
    """Bytes of each data cache of the first CPU core as Linux reports it ({"L1d": .., "L2": .., "L3": ..});
    empty where the system does not say (not Linux, or a container that hides /sys)."""
    sizes, units = {}, {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for index in sorted(Path(root).glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        if kind == "Instruction":
            continue
        name = f"L{level}" + ("d" if kind == "Data" else "")
        sizes[name] = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return sizes


def measure_matmul_flops(n: int | None = None, dtype: torch.dtype | None = None, device=None,
                         repeats: int = 5) -> float:
    """Matmul throughput in FLOP/s: the median time of one n x n by n x n product (2 n^3 FLOPs)."""
    device = _default_device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    n = n or (8192 if device.type == "cuda" else 2048)
    x, y = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return 2 * n ** 3 / time_median(lambda: x @ y, device, repeats, warmup=2)


@functools.cache
def int8_peak_library():
    """`kernels/int8_peak.c` built for this CPU and loaded: `int8_macs(iters, sink)`, or None where it cannot be
    built."""
    from .kernels.cpu import build_and_load

    lib = build_and_load(Path(__file__).parent / "kernels" / "int8_peak.c")
    if lib is not None:
        for fn in (lib.int8_macs, lib.int8_macs_amx):
            fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_int64, ctypes.c_void_p]
    return lib


def measure_int8_peak(seconds: float = 0.2, amx: bool | None = None) -> float:
    """8-bit multiply-adds per second on this CPU with the instructions of minillm's int4/int8 kernel
    (`kernels/int8_peak.c`: independent accumulators, nothing read from memory), on torch's threads; the best of 5
    calls of about `seconds` each. The arithmetic roof of a batched quantized step, as `measure_bandwidth` is its
    bytes roof. `amx`: the AMX tile product's rate rather than the vector instructions' (None: whichever the kernel
    uses for 16 rows or more, `int4_cpu_amx`). Raises where the C file cannot be built or this CPU has neither
    AVX512-VNNI nor AVX2 (nor, asked for, AMX)."""
    from .kernels.int4_cpu import int4_cpu_amx

    lib = int8_peak_library()
    if lib is None:
        raise RuntimeError("kernels/int8_peak.c could not be built here (is a C compiler installed?)")
    loop = lib.int8_macs_amx if (int4_cpu_amx() if amx is None else amx) else lib.int8_macs
    sink, iters = ctypes.c_int32(0), 1 << 12
    while True:  # grow the loop until one call takes about `seconds`
        start = time.perf_counter()
        if loop(iters, ctypes.byref(sink)) == 0:
            raise RuntimeError("this CPU has neither AVX512-VNNI nor AVX2: the kernel multiplies in plain C"
                               if loop is lib.int8_macs else "no AMX here (the CPU, the build or Linux)")
        if time.perf_counter() - start > seconds / 2:
            break
        iters *= 2
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        macs = loop(iters, ctypes.byref(sink))
        best = max(best, macs / (time.perf_counter() - start))
    return best


def step_macs(model, batch: int = 1) -> int:
    """Multiply-adds of a decode step's weight products at `batch` rows: every linear layer of `decode_linears`
    and the head."""
    config = model.config
    return batch * (sum(lin.in_features * lin.out_features for lin in decode_linears(model))
                    + config.vocab_size * config.hidden_size)


def decode_linears(model) -> list:
    """The linear layers a decode step runs, in call order: q/k/v, o, gate/up, down of every block (not the head)."""
    return [lin for layer in model.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                      layer.mlp.gate_up_proj, layer.mlp.down_proj)]


def matvec_step(model, batch: int = 1) -> Callable[[], None]:
    """A decode step stripped to its matrix products: `[batch, in]` inputs through each of the model's own linear
    layers and its head, called as the model calls them (oneDNN-packed where the model is), and nothing else
    (no attention, norms, Python between layers)."""
    linears = decode_linears(model)
    weight = model.norm.weight  # for device and dtype (a quantized layer has no float weight)
    inputs = {n: torch.randn(batch, n, device=weight.device, dtype=weight.dtype)
              for n in {lin.in_features for lin in linears}}
    hidden = inputs[model.config.hidden_size]

    @torch.inference_mode()
    def step() -> None:
        for lin in linears:
            lin.forward(inputs[lin.in_features])
        model.logits(hidden)
    return step


def step_weight_bytes(model) -> int:
    """Bytes of weights one decode step of `model` reads, as stored (float or quantized): each linear layer of
    `decode_linears` once, and the head once."""
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    return sum(m.nbytes if hasattr(m, "nbytes") else m.weight.nbytes for m in decode_linears(model) + [head])


def start_request(engine, prompt_ids: list[int], tokens: int) -> None:
    """Add to `engine` (an `LLMEngine`) a request for `tokens` tokens after its first, and step it through its
    prefill (which samples that first token): its next `tokens` steps, alone, are batch-1 decode steps."""
    from .sampling import SamplingParams

    engine.add_request(None, prompt_ids, SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
    engine.step()


def engine_and_bare(engine, prompt_ids: list[int], tokens: int, bare: Callable[[], None]
                    ) -> tuple[list[float], list[float]]:
    """Seconds of each batch-1 decode step of `engine` (an `LLMEngine`) over `tokens` new tokens, each step
    followed at once by one call of `bare` (e.g. `matvec_step`), so both see the same machine (load, clocks)."""
    start_request(engine, prompt_ids, tokens)
    return paired_steps(engine, bare, tokens)


def running_kv_bytes(engine) -> float:
    """Bytes of cache a decode step of `engine`'s running batch reads at the least: every running sequence's cached
    keys and values, at the pool's bytes per token (scales included)."""
    kv = engine.kv_cache
    per_token = kv.nbytes / (kv.num_blocks * kv.block_size)
    return per_token * sum(s.num_tokens for s in engine.scheduler.running)


def running_step_bytes(engine) -> float:
    """Bytes a decode step of `engine`'s running batch reads at the least: its weights once (`step_weight_bytes`)
    and its cached keys and values (`running_kv_bytes`)."""
    return step_weight_bytes(engine.model) + running_kv_bytes(engine)


def start_decoding(engine, batch: int, context: int, gen: torch.Generator) -> list[str]:
    """Add `batch` requests with random prompts of `context` tokens to `engine` (an `LLMEngine`) and step until
    all are decoding; their ids. They run until aborted (the first ones admitted decode while the last ones are
    still being prefilled)."""
    from .sampling import SamplingParams

    vocab = engine.config.vocab_size
    ids = [engine.add_request(None, torch.randint(0, vocab, (context,), generator=gen).tolist(),
                              SamplingParams(max_tokens=10_000, ignore_eos=True)) for _ in range(batch)]
    while engine.num_waiting_seqs() or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    if len(engine.scheduler.running) != batch:
        raise RuntimeError(f"only {len(engine.scheduler.running)} of {batch} requests decode at once; the engine "
                           f"needs max_num_seqs >= {batch} and KV blocks for all of them")
    return ids


def paired_steps(engine, bare: Callable[[], None], steps: int) -> tuple[list[float], list[float]]:
    """Seconds of `steps` decode steps of `engine`, each followed at once by one call of `bare` (e.g.
    `matvec_step` at the running batch), so both see the same machine (load, clocks)."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    engine_times, bare_times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()  # samples with .tolist(): the step has finished on the device when it returns
        middle = time.perf_counter()
        bare()
        sync()
        engine_times.append(middle - start)
        bare_times.append(time.perf_counter() - middle)
    return engine_times, bare_times


def alternated_steps(engine, bare, steps: int) -> dict[bool, tuple[list[float], list[float]]]:
    """`paired_steps` both ways, keyed by `use_fused_step` (True: in one call, as the engine runs; False: layer by
    layer through the modules): `steps` decode steps of `engine` each way, alternating step by step so that a slow
    spell of the machine weighs on both, each followed at once by one call of `bare`, whose seconds come second."""
    model, default, out = engine.model, engine.model.use_fused_step, {True: ([], []), False: ([], [])}
    try:
        for i in range(steps):
            for fused in (True, False) if i % 2 == 0 else (False, True):
                model.use_fused_step = fused and default
                engine_s, bare_s = paired_steps(engine, bare, 1)
                out[fused][0].extend(engine_s)
                out[fused][1].extend(bare_s)
    finally:
        model.use_fused_step = default
    return out


# ---- memory budget ----------------------------------------------------------------------------------------


def weight_bytes(config: ModelConfig, fmt: str) -> float:
    """Bytes of the weights alone in format `fmt` (one of WEIGHT_FORMATS)."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {fmt!r} is unknown; use one of {list(WEIGHT_FORMATS)}")
    return config.num_params * WEIGHT_FORMATS[fmt]


def memory_budget(configs: dict[str, ModelConfig], formats: Sequence[str] = tuple(WEIGHT_FORMATS),
                  kv_dtype_bytes: int = 2) -> list[dict]:
    """One row per model: parameter count, weight bytes per format, and KV-cache bytes per token (chapter 3)."""
    from .kv_cache import kv_cache_bytes

    return [{"model": name, "params": cfg.num_params, **{fmt: weight_bytes(cfg, fmt) for fmt in formats},
             "kv_per_token": kv_cache_bytes(1, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype_bytes)}
            for name, cfg in configs.items()]
