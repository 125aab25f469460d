"""RMSNorm, RoPE and SiLU times up in C (`minillm/kernels/small_ops.c`) against their PyTorch definitions in
`minillm.layers`, which still run where a gradient is wanted, a dispatch mode watches, or the tensors are not
float32 on a CPU; and greedy sampling's argmax against PyTorch's max."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from minillm import layers, sampling
from minillm.kernels.small_ops import small_ops_available

pytestmark = pytest.mark.skipif(not small_ops_available(), reason="no C compiler here")


def both(fn, *args):
    """`fn(*args)` as the C function computes it (no gradient), and as PyTorch does (a gradient enabled)."""
    with torch.no_grad():
        assert layers.runs_in_c(*[a for a in args if isinstance(a, torch.Tensor)])
        ours = fn(*args)
    with torch.enable_grad():
        theirs = fn(*args)
    return ours, theirs


@pytest.mark.parametrize("tokens", [1, 7, 300])  # 300 rows: the threaded path
def test_rms_norm_and_silu_match_pytorch(tokens):
    gen = torch.Generator().manual_seed(tokens)
    x, gain = torch.randn(tokens, 576, generator=gen) * 3, torch.rand(576, generator=gen) + 0.5
    ours, theirs = both(layers.rms_norm, x, gain, 1e-5)
    torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=1e-6)
    strided = torch.randn(tokens, 2 * 576, generator=gen)[:, :576]  # rows contiguous, not the whole tensor
    ours, theirs = both(layers.rms_norm, strided, gain, 1e-5)
    torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=1e-6)
    gate_up = torch.randn(tokens, 2 * 1536, generator=gen) * 4
    ours, theirs = both(layers.silu_and_mul, gate_up)
    torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=1e-6)
    assert ours.shape == (tokens, 1536)


@pytest.mark.parametrize("tokens", [1, 5, 120])
def test_rope_matches_pytorch_on_the_q_and_k_heads_of_a_qkv_row(tokens):
    """As the attention layer calls it: q and k heads, a slice of each token's q, k and v (rows not contiguous)."""
    rope = layers.RotaryEmbedding(64, 1e5, 4096)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(tokens))
    cos, sin_signed = rope.cos_sin(positions, torch.float32)
    qkv = torch.randn(tokens, 9 + 2 * 3, 64)
    x = qkv[:, :12]
    ours, theirs = both(layers.rotate, x, cos, sin_signed)
    torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=1e-6)
    assert not ours.data_ptr() == x.data_ptr() and torch.equal(x, qkv[:, :12])  # a new tensor; x untouched


def test_pytorch_runs_where_the_c_functions_do_not_apply():
    x, gain = torch.randn(2, 64), torch.ones(64)
    with torch.no_grad():
        assert layers.runs_in_c(x, gain)
        assert not layers.runs_in_c(x.double()) and not layers.runs_in_c(x.bfloat16())
        with FlopCounterMode(display=False):  # a dispatch mode sees every operation, so none may bypass it
            assert not layers.runs_in_c(x, gain)
    w = gain.clone().requires_grad_()
    layers.rms_norm(x, w, 1e-6).sum().backward()  # a gradient wanted: PyTorch's, which autograd differentiates
    torch.testing.assert_close(w.grad, F.rms_norm(x, (64,), eps=1e-6).sum(0))


@pytest.mark.parametrize("vocab", [1, 63, 64, 65, 1000, 49152])
@pytest.mark.parametrize("rows", [1, 3, 40])  # 40 rows of 49152: the threaded path
def test_argmax_matches_pytorch_s_first_top_value_and_its_non_finite_rows(rows, vocab):
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen).round(decimals=1)  # few distinct values: ties everywhere
    if rows >= 3:
        logits[1, -1] = logits[1].max() + 1  # the top value last
        logits[2, :] = -math.inf  # every token masked: no argmax
    if rows >= 40 and vocab >= 64:
        logits[3, 5], logits[4, -1], logits[5, 0] = math.nan, math.inf, math.nan  # a NaN or +inf: none either
        logits[6, ::2] = -math.inf  # half masked: the argmax among the rest
        logits[7] = 0.0
        logits[7, vocab // 2:] = -0.0  # +0 and -0 are equal: the first is the argmax
        logits[8, :] = -3.0e38  # all equal and finite: index 0
        logits[9, -1] = math.inf  # +inf in the last chunk only
    with torch.no_grad():
        assert layers.runs_in_c(logits)
        ours = sampling.first_argmax(logits)
    with torch.enable_grad():  # PyTorch's max
        theirs = sampling.first_argmax(logits)
    assert ours == theirs
    if rows >= 40 and vocab >= 64:
        assert ours[2:6] == [-1, -1, -1, -1] and ours[7] == 0 and ours[8] == 0 and ours[9] == -1


def test_the_engine_s_greedy_steps_take_the_c_argmax(tiny_llama, monkeypatch):
    """The engine samples outside the model's forward pass; it runs under inference mode too, so that greedy
    decoding on a CPU takes the C loop at every step rather than PyTorch's max."""
    from minillm import LLM, SamplingParams
    from minillm.kernels import small_ops

    llm = LLM(tiny_llama, device="cpu", dtype=torch.float32, num_kv_blocks=32, enable_prefix_caching=False)
    calls, argmax = [], small_ops.argmax
    monkeypatch.setattr(small_ops, "argmax", lambda logits: calls.append(logits.shape) or argmax(logits))
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4 and len(calls) == 4
