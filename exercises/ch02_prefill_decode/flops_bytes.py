"""Exercise 2 — prefill and decode on the roofline: count the FLOPs and bytes of a Llama-family forward pass.

Replace each `raise NotImplementedError(...)` with your code, then run `make grade CH=02`.
Plain Python arithmetic is enough; use nothing else from minillm.roofline (that is what you are rebuilding).
`config` is a `minillm.config.ModelConfig`; read its fields: vocab_size, hidden_size, intermediate_size,
num_layers, num_heads, num_kv_heads, head_dim, qkv_bias.
"""

from collections.abc import Sequence

from minillm.roofline import OpCost  # given: the record of one op's FLOPs and bytes (read its docstring)


def forward_costs(config, query_lens: Sequence[int], context_lens: Sequence[int], dtype_bytes: float = 2,
                  weight_bytes: float | None = None) -> list[OpCost]:
    """Every op of one forward pass over a batch of sequences, as a list of 14 OpCost in this order.

    Sequence s brings `query_lens[s]` new tokens and attends to `context_lens[s]` tokens in all (the cached
    ones plus its new ones). Raise ValueError if the two lists differ in length or are empty, or if any
    sequence has query_len < 1 or context_len < query_len.

    Notation: T = total new tokens, S = number of sequences, h = hidden_size, d = head_dim, H = num_heads,
    q = H*d, kv = num_kv_heads*d, I = intermediate_size, V = vocab_size, L = num_layers;
    a = dtype_bytes (activations, KV cache), w = weight_bytes (parameters; None means the same as a).

    Conventions: a multiply-add is 2 FLOPs. Bytes are ideal traffic: every tensor an op reads or writes is
    counted once (a weight matrix once, however many tokens use it). Causal attention: a new token at
    position p (0-based; the new tokens of a sequence are its last query_len positions) sees the p + 1 keys
    at positions 0..p, and each (query, key) pair costs the FLOPs below; each sequence's K and V are read once.

    The 14 ops, each with its repeat (1 or L), its FLOPs, and its bytes as weights / activations / KV cache:

    embed_tokens  (1)  gathers one embedding row per new token. 0 FLOPs. Weights: min(T, V) rows of h;
                       activations: the T x h output written.
    rms_norm x2   (L)  the block's two RMSNorms, each over T x h: 4 FLOPs per element each. Weights: both gains
                       (h each); activations: each reads and writes T x h.
    qkv_proj      (L)  linear h -> q + 2 kv, plus its bias when config.qkv_bias (1 FLOP per output element).
                       Weights: the matrix (and bias); activations: the T x h input and the T x (q + 2 kv) output.
    rope          (L)  rotates q and k: 3 FLOPs per element of q and of k. Activations: reads and writes q and k.
    store_kv      (L)  copies the new k and v into the cache: 0 FLOPs. Activations: reads k and v;
                       KV: writes k and v.
    attn_scores   (L)  q.k for every (query, key) pair and head, then softmax: 2 d + 5 FLOPs per pair per head.
                       Activations: reads q; KV: reads every sequence's context_len keys (kv wide) once.
    attn_values   (L)  probabilities times V: 2 d FLOPs per pair per head. Activations: writes the T x q output;
                       KV: reads every sequence's context_len values once.
    o_proj        (L)  linear q -> h. Weights: the matrix; activations: input and output.
    residual x2   (L)  the block's two residual adds over T x h: 1 FLOP per element each. Activations: each
                       reads two T x h tensors and writes one.
    gate_up_proj  (L)  linear h -> 2 I. Weights: the matrix; activations: input and output.
    silu_and_mul  (L)  silu(gate) * up: 5 FLOPs per element of its T x I output. Activations: reads gate and up
                       (T x I each), writes the output.
    down_proj     (L)  linear I -> h. Weights: the matrix; activations: input and output.
    final_norm    (1)  RMSNorm of all T hidden states: 4 FLOPs per element. Weights: the gain; activations:
                       reads and writes T x h.
    lm_head       (1)  logits of each sequence's LAST new token only: linear h -> V on S rows. Weights: the
                       V x h matrix; activations: the S x h input and the S x V logits.

    A linear layer on R rows costs 2 * R * in * out FLOPs. Ops with nothing in a column have 0 there.
    """
    raise NotImplementedError("forward_costs: write this function")


def prefill_costs(config, num_tokens: int, dtype_bytes: float = 2, num_seqs: int = 1,
                  weight_bytes: float | None = None) -> list[OpCost]:
    """Prefill of `num_seqs` fresh prompts of `num_tokens` tokens each (nothing cached before): forward_costs."""
    raise NotImplementedError("prefill_costs: write this function")


def decode_costs(config, batch: int, context_len: int, dtype_bytes: float = 2,
                 weight_bytes: float | None = None) -> list[OpCost]:
    """One decode step: `batch` sequences, one new token each, each attending to `context_len` tokens
    (its new one included): forward_costs."""
    raise NotImplementedError("decode_costs: write this function")


def total_flops(ops: Sequence[OpCost]) -> float:
    """FLOPs of the whole forward pass: every op times its `repeat`."""
    raise NotImplementedError("total_flops: write this function")


def total_bytes(ops: Sequence[OpCost]) -> float:
    """Bytes of the whole forward pass: every op's bytes times its `repeat`."""
    raise NotImplementedError("total_bytes: write this function")


def arithmetic_intensity(ops: Sequence[OpCost]) -> float:
    """FLOPs per byte of the whole pass (total FLOPs / total bytes): its place on the roofline's x axis."""
    raise NotImplementedError("arithmetic_intensity: write this function")


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """The intensity (FLOP/byte) where the compute roof (FLOP/s) meets the bandwidth roof (bytes/s)."""
    raise NotImplementedError("ridge_point: write this function")
