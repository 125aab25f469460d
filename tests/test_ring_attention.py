"""Sequence-parallel ring attention on 2 and 3 gloo ranks (loopback) equals attention over the whole sequence on
one process, for odd lengths, causal or not, with grouped-query heads; the bytes it sends are what the ring
should send; and no worker process outlives a test, even one whose ranks raise."""

import multiprocessing

import pytest
import torch
import torch.nn.functional as F

from minillm.parallel.comm import run_group
from minillm.parallel.ring_attention import ring_attention, split_sequence


def _inputs(total, heads, kv_heads, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(total, heads, d, generator=gen), torch.randn(total, kv_heads, d, generator=gen),
            torch.randn(total, kv_heads, d, generator=gen))


def _ring_rank(comm, total, heads, kv_heads, causal):
    q, k, v = _inputs(total, heads, kv_heads)
    start, end = split_sequence(total, comm.world_size)[comm.rank]
    out = ring_attention(comm, q[start:end], k[start:end], v[start:end], start, total, causal)
    return out, dict(comm.stats)


def _full(total, heads, kv_heads, causal):
    q, k, v = _inputs(total, heads, kv_heads)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=causal,
                                       enable_gqa=True)
    return o.transpose(0, 1)


@pytest.mark.parametrize("world_size,total,heads,kv_heads,causal",
                         [(2, 37, 4, 2, True), (3, 37, 6, 2, True), (3, 20, 3, 3, False), (2, 2, 2, 1, True)])
def test_ring_equals_full_attention(world_size, total, heads, kv_heads, causal):
    results = run_group(_ring_rank, world_size, total, heads, kv_heads, causal)
    out = torch.cat([o for o, _ in results])
    torch.testing.assert_close(out, _full(total, heads, kv_heads, causal), atol=1e-5, rtol=1e-5)
    # each rank passes P - 1 blocks of K and V (padded to the longest slice) and their headers
    longest, d = -(-total // world_size), 16
    block_bytes = 2 * longest * kv_heads * d * 4 + 2 * 8
    for _, stats in results:
        assert stats["send_recv"].calls == 2 * (world_size - 1)
        assert stats["send_recv"].bytes == (world_size - 1) * block_bytes


def _fails_on_rank_1(comm):
    if comm.rank == 1:
        raise ValueError("deliberate")
    return comm.rank


def test_a_failing_rank_is_reported_and_no_process_is_left():
    before = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="rank 1: ValueError: deliberate"):
        run_group(_fails_on_rank_1, 2, timeout=60)
    assert set(multiprocessing.active_children()) <= before


def test_split_and_errors():
    assert split_sequence(7, 3) == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(ValueError, match="2 tokens"):
        split_sequence(2, 3)
    with pytest.raises(ValueError, match="world_size"):
        run_group(_fails_on_rank_1, 0)


def _sockets(comm):
    """This rank's TCP sockets as `ss` lists them, after a collective has connected the group."""
    import os
    import subprocess

    comm.all_reduce(torch.ones(4))
    lines = subprocess.run(["ss", "-tanp"], capture_output=True, text=True, check=True).stdout.splitlines()
    return [line.split()[3:5] for line in lines if f"pid={os.getpid()}," in line]


def test_process_groups_use_loopback_only():
    import shutil

    if shutil.which("ss") is None:
        pytest.skip("needs the ss command (iproute2)")
    for sockets in run_group(_sockets, 2):
        assert sockets, "ss showed no sockets for the rank"
        for local, peer in sockets:
            for address in (local, peer):
                host = address.rsplit(":", 1)[0].strip("[]")
                assert host in ("127.0.0.1", "::ffff:127.0.0.1", "::1") or address in ("0.0.0.0:*", "*:*"), address
