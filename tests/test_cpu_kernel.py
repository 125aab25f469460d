"""The C decode kernel against the PyTorch decode path it replaces, and the engine's choice between them."""

import ctypes
import os
import platform

import pytest
import torch

from minillm.attention import _Part, decode_attention, quantize_kv
from minillm.kernels import cpu, use_cpu_kernel
from minillm.kernels.cpu import cpu_kernel_available, paged_decode_attention

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="no C compiler to build the kernel with")


def paged_case(seed, batch, heads, kv_heads, dim, block_size, max_len, num_blocks=200):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen) for _ in range(2))
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen, dtype=torch.int32)
    width = -(-int(lens.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[:batch * width].view(batch, width).int()
    q = torch.randn(batch, heads, dim, generator=gen)
    return q, k_cache, v_cache, tables, lens


@pytest.mark.parametrize("batch,heads,kv_heads,dim,block_size,max_len", [
    (1, 9, 3, 64, 16, 1), (1, 9, 3, 64, 16, 37), (7, 9, 3, 64, 16, 100), (5, 8, 8, 32, 4, 50),
    (3, 8, 1, 128, 8, 61), (16, 4, 2, 16, 1, 9)])
def test_matches_torch_decode(batch, heads, kv_heads, dim, block_size, max_len):
    q, k_cache, v_cache, tables, lens = paged_case(batch * max_len, batch, heads, kv_heads, dim, block_size, max_len)
    expected = decode_attention(q, k_cache, v_cache, _Part(tables, lens, [1] * batch), dim ** -0.5)
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


INT8_CASES = [(1, 9, 3, 64, 16, 1), (7, 9, 3, 64, 16, 100), (3, 8, 2, 64, 16, 40), (2, 10, 2, 64, 8, 70),
              (4, 6, 6, 64, 16, 33), (3, 8, 1, 128, 8, 61), (16, 4, 2, 16, 1, 9)]  # groups of 3, 4, 5, 1 at 64 wide


@pytest.mark.parametrize("batch,heads,kv_heads,dim,block_size,max_len", INT8_CASES)
def test_int8_pool_matches_torch_decode(batch, heads, kv_heads, dim, block_size, max_len):
    """An int8 pool with a scale per vector: the kernel dequantizes as it reads, PyTorch after gathering."""
    q, k_float, v_float, tables, lens = paged_case(batch + max_len, batch, heads, kv_heads, dim, block_size, max_len)
    (k_cache, k_scale), (v_cache, v_scale) = (quantize_kv(c, torch.int8) for c in (k_float, v_float))
    expected = decode_attention(q, k_cache, v_cache, _Part(tables, lens, [1] * batch), dim ** -0.5, k_scale, v_scale)
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5, k_scale, v_scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set flags")
def test_int8_pool_without_avx512(tmp_path, monkeypatch):
    """The same source built without AVX-512, where 64-wide heads take the plain C loops, not the registers."""
    monkeypatch.setattr(cpu, "COMPILE_FLAGS", cpu.COMPILE_FLAGS + ["-mno-avx512f"])
    lib = cpu._declare(ctypes.CDLL(str(cpu._build(cpu.SOURCE, tmp_path))))
    monkeypatch.setattr(cpu, "_library", lambda: lib)
    for batch, heads, kv_heads, dim, block_size, max_len in INT8_CASES:
        test_int8_pool_matches_torch_decode(batch, heads, kv_heads, dim, block_size, max_len)


def test_cpu_march_from_the_environment():
    """MINILLM_CPU_MARCH picks the compiler's target (make test-portable builds for AVX2 with it)."""
    import subprocess
    import sys

    code = "from minillm.kernels import cpu; print(cpu.COMPILE_FLAGS[1])"
    base = {k: v for k, v in os.environ.items() if k != "MINILLM_CPU_MARCH"}
    for env, flag in ({}, "-march=native"), ({"MINILLM_CPU_MARCH": "x86-64-v3"}, "-march=x86-64-v3"):
        out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                             check=True, timeout=120)
        assert out.stdout.split() == [flag]


def test_int8_pool_needs_its_scales():
    q, k_float, v_float, tables, lens = paged_case(2, 2, 4, 2, 8, 4, 10, num_blocks=8)
    (k_cache, k_scale), (v_cache, v_scale) = (quantize_kv(c, torch.int8) for c in (k_float, v_float))
    with pytest.raises(ValueError, match="scales"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="scales"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0, k_scale[:, :2], v_scale)
    with pytest.raises(ValueError, match="scales"):
        paged_decode_attention(q, k_float, v_float, tables, lens, 1.0, k_scale, v_scale)


def test_strided_queries_and_int64_tables():
    """The engine's queries are a view into the fused q/k projection: rows further apart than heads * dim."""
    q, k_cache, v_cache, tables, lens = paged_case(0, 6, 9, 3, 64, 16, 70)
    wide = torch.randn(6, 15, 64)
    wide[:, :9] = q
    got = paged_decode_attention(wide[:, :9], k_cache, v_cache, tables.long(), lens.long(), 0.125)
    torch.testing.assert_close(got, paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125))


def test_refuses_what_it_cannot_read():
    q, k_cache, v_cache, tables, lens = paged_case(1, 2, 4, 2, 8, 4, 10, num_blocks=8)
    with pytest.raises(ValueError, match="float32"):
        paged_decode_attention(q.double(), k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="fit in its block table"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens + 100, 1.0)
    with pytest.raises(ValueError, match="at least 1"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens * 0, 1.0)
    with pytest.raises(ValueError, match="outside the cache"):
        paged_decode_attention(q, k_cache, v_cache, tables + 8, lens, 1.0)
    with pytest.raises(ValueError, match="shapes do not match"):
        paged_decode_attention(q[:, :3], k_cache, v_cache, tables, lens, 1.0)


def test_choice(monkeypatch):
    monkeypatch.delenv("MINILLM_ATTENTION", raising=False)
    assert use_cpu_kernel("cpu", torch.float32)
    assert not use_cpu_kernel("cpu", torch.bfloat16) and not use_cpu_kernel("cuda", torch.float32)
    monkeypatch.setenv("MINILLM_ATTENTION", "torch")
    assert not use_cpu_kernel("cpu", torch.float32)


@pytest.mark.parametrize("pool", [torch.float32, torch.int8])
@pytest.mark.parametrize("batch,heads,kv_heads,dim,block_size,max_len", [(1, 9, 3, 64, 16, 37), (7, 9, 3, 64, 16, 100),
                                                                         (3, 8, 1, 128, 8, 61)])
def test_one_call_per_layer_equals_rope_store_and_attention_one_by_one(pool, batch, heads, kv_heads, dim, block_size,
                                                                       max_len):
    """`cpu_decode_layer` (one C call) against `rotate`, `store_kv` and the kernel called in turn, on copies of the
    same pool: the same output and the same pool afterwards, bit for bit."""
    from minillm.attention import AttentionMetadata, cpu_decode_attention, cpu_decode_layer, store_kv
    from minillm.layers import rotate

    _, k_cache, v_cache, tables, lens = paged_case(batch + dim, batch, heads, kv_heads, dim, block_size, max_len)
    gen = torch.Generator().manual_seed(dim)
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim, generator=gen)
    cos, sin = (torch.randn(batch, 1, dim, generator=gen) for _ in range(2))
    blocks = torch.stack([tables[i, (int(lens[i]) - 1) // block_size] for i in range(batch)]).long()
    slots = blocks * block_size + (lens.long() - 1) % block_size  # each sequence's newest token
    pools = []
    for _ in range(2):
        if pool == torch.int8:
            (kq, ks), (vq, vs) = (quantize_kv(c, torch.int8) for c in (k_cache, v_cache))
            pools.append([kq, vq, ks.view(k_cache.shape[:3]).contiguous(), vs.view(k_cache.shape[:3]).contiguous()])
        else:
            pools.append([k_cache.clone(), v_cache.clone()])
    meta = AttentionMetadata(slots, tables, lens, [1] * batch, 0, use_cpu_kernel=True)
    with torch.inference_mode():  # as the engine runs (the C functions step aside for autograd)
        got = cpu_decode_layer(qkv.clone(), (cos, sin), *pools[0][:2], meta, heads, dim ** -0.5, *pools[0][2:])
        heads_ = qkv.view(batch, heads + 2 * kv_heads, dim)
        q, k = rotate(heads_[:, :heads + kv_heads], cos, sin).split([heads, kv_heads], dim=1)
        store_kv(k, heads_[:, heads + kv_heads:], pools[1][0], pools[1][1], slots, *pools[1][2:])
        want = cpu_decode_attention(q, pools[1][0], pools[1][1], meta.decode, dim ** -0.5, *pools[1][2:])
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(*pools))
