"""Grader for exercise 4: your block manager and paged attention against minillm's, step by step."""

import random

import pytest
import torch
from torch.testing import assert_close

from minillm.metrics import RequestMetrics
from minillm.sampling import SamplingParams
from minillm.scheduler import Scheduler
from minillm.sequence import Sequence


def seq(name, token_ids, max_tokens=16):
    return Sequence(name, None, list(token_ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    RequestMetrics(0.0))


def state(bm, seqs):
    """Everything the engine can observe of a block manager and its sequences."""
    return {"free blocks": bm.num_free_blocks, "ref counts": [b.ref_count for b in bm.blocks],
            "block tables": {s.request_id: list(s.block_table) for s in seqs},
            "cached tokens": {s.request_id: s.num_cached_tokens for s in seqs},
            "hit/query tokens": (bm.hit_tokens, bm.query_tokens)}


class Script:
    """Runs the same operations on a block manager and records (label, result, state) after each one."""

    def __init__(self, manager_cls, num_blocks, block_size, prefix=True):
        self.bm, self.seqs, self.log = manager_cls(num_blocks, block_size, prefix), {}, []

    def record(self, label, result):
        self.log.append((label, result, state(self.bm, self.seqs.values())))
        return result

    def allocate(self, name, token_ids, reserve=0):
        self.seqs[name] = seq(name, token_ids)
        if not reserve:  # as the scheduler calls it when nothing else runs
            return self.record(f"allocate({name}, {len(token_ids)} tokens)", self.bm.allocate(self.seqs[name]))
        label = f"allocate({name}, {len(token_ids)} tokens, reserve={reserve})"
        return self.record(label, self.bm.allocate(self.seqs[name], reserve=reserve))

    def step(self, name, new_tokens=None):
        """What the engine does for one step of the sequence: grow, compute, commit (and emit a token)."""
        s = self.seqs[name]
        n = s.num_tokens - s.num_cached_tokens if new_tokens is None else new_tokens
        ok = self.bm.can_grow(s, s.num_cached_tokens + n)
        copies = self.bm.grow(s, s.num_cached_tokens + n) if ok else None
        if ok:
            s.num_cached_tokens += n
            self.bm.commit(s)
        return self.record(f"step({name}, {n} new tokens): can_grow, grow copies", (ok, copies))

    def emit(self, name, token):
        self.seqs[name].output_token_ids.append(token)

    def free(self, name):
        self.bm.free(self.seqs[name])
        return self.record(f"free({name})", None)


def compare(impl_script, ref_script, where):
    """The first operation after which the two differ, with what differed."""
    assert len(impl_script.log) == len(ref_script.log)
    for (label, got, got_state), (_, want, want_state) in zip(impl_script.log, ref_script.log):
        assert got == want, f"{where}: {label} returned {got!r}, expected {want!r}"
        for key in want_state:
            assert got_state[key] == want_state[key], \
                f"{where}: after {label}, {key} = {got_state[key]}, expected {want_state[key]}"


def both(impl, ref, scenario, *args, where=""):
    scripts = []
    for module in (ref, impl):
        script = Script(module.BlockManager, *args)
        scenario(script)
        scripts.append(script)
    compare(scripts[1], scripts[0], where or scenario.__qualname__.split(".")[0])


@pytest.mark.points(2)
def test_allocate_and_free(impl, ref):
    def scenario(s):
        s.allocate("a", range(10))        # 3 blocks of 4
        s.allocate("b", range(50, 54))    # exactly one block
        s.allocate("c", [7])              # a single token
        s.free("a")                       # blocks return to the END of the free list, last block first
        s.allocate("d", range(60, 80))    # takes the oldest free blocks first, then a's
        s.free("c")
        s.free("b")
        s.allocate("e", range(80, 84))
    both(impl, ref, scenario, 8, 4, False)
    both(impl, ref, scenario, 26, 1, False, where="block_size 1")
    for block_size in (4, 16):
        bm = impl.BlockManager(8, block_size, False)
        assert [bm.blocks_needed(n) for n in (1, block_size, block_size + 1, 5 * block_size)] == [1, 1, 2, 5], \
            "blocks_needed is ceil(num_tokens / block_size)"


@pytest.mark.points(1)
def test_allocate_refuses_without_changes(impl, ref):
    def scenario(s):
        s.allocate("a", range(9))         # 3 of 5 blocks
        s.allocate("big", range(100, 113))  # needs 4, only 2 free: False, nothing changes
        s.allocate("b", range(200, 208))  # 2 blocks still fit
        s.allocate("c", [1])              # and now nothing does
    both(impl, ref, scenario, 5, 4, False)
    both(impl, ref, scenario, 5, 4, True, where="with prefix caching")


@pytest.mark.points(1)
def test_allocate_keeps_the_reserve_free(impl, ref):
    def scenario(s):
        s.allocate("a", range(9))                    # 3 of 8 blocks; 5 free
        s.allocate("b", range(100, 108), reserve=4)  # 2 blocks would leave 3 < 4 free: refused, no change
        s.allocate("b", range(100, 108), reserve=3)  # leaves exactly 3: fits
        s.step("b")
        s.free("b")                                  # b's blocks go back to the free list, still cached
        s.allocate("c", range(100, 108), reserve=4)  # hits reclaimed from the free list count too
        s.allocate("c", range(100, 108), reserve=3)
    both(impl, ref, scenario, 8, 4, True)
    both(impl, ref, scenario, 8, 4, False, where="prefix caching off")


@pytest.mark.points(2)
def test_grow_one_token_at_a_time(impl, ref):
    def scenario(s):
        s.allocate("a", range(5))
        s.step("a")                       # prefill of 5 tokens
        s.allocate("b", range(20, 23))
        s.step("b")
        for t in range(9):                # decode: a new block every 4 tokens, interleaved with b
            for name in ("a", "b"):
                s.emit(name, 300 + t)
                s.step(name)
    both(impl, ref, scenario, 8, 4, False)
    both(impl, ref, scenario, 8, 4, True, where="with prefix caching")
    both(impl, ref, scenario, 6, 4, False, where="a pool too small: can_grow must say False")


@pytest.mark.points(2)
def test_prefix_sharing_and_reference_counts(impl, ref):
    system = list(range(100, 110))        # 2 full blocks of 4 and a partial one
    def scenario(s):
        s.allocate("a", system + [1, 2])
        s.step("a")                       # computed: a's full blocks get hashed and indexed
        s.allocate("b", system + [3, 4, 5, 6])  # shares the 2 full blocks, not the partial third
        s.step("b")
        s.allocate("c", system[:8] + [9, 9, 9, 9])  # shares 2 blocks; its third block differs
        s.allocate("d", [100, 101, 102, 0])  # first block differs in one token: no hit
        s.allocate("e", system[4:])       # the same tokens in another position: no hit (chained hash)
        s.free("a")
        s.free("b")
    both(impl, ref, scenario, 32, 4, True)
    both(impl, ref, scenario, 32, 4, False, where="prefix caching off: nothing is shared")


@pytest.mark.points(1)
def test_full_hit_recomputes_the_last_token(impl, ref):
    def scenario(s):
        s.allocate("a", range(8))
        s.step("a")
        s.free("a")                       # a's blocks sit on the free list, still cached
        s.allocate("b", range(8))         # a full hit, reclaimed from the free list; 7 cached
        s.step("b")
        s.allocate("c", range(6))         # one full block and a partial one
    both(impl, ref, scenario, 6, 4, True)


@pytest.mark.points(2)
def test_copy_on_write(impl, ref):
    def scenario(s):
        s.allocate("a", range(8))
        s.step("a")
        s.allocate("b", range(8))         # full hit on blocks a holds: b will write into a shared block
        s.step("b")                       # grow copies a's last block into a fresh one for b
        s.emit("a", 50)
        s.step("a")
        s.emit("b", 51)
        s.step("b")
        s.allocate("c", range(8))         # and again, now with a third holder of the first block
        s.step("c")
        for name in ("a", "b", "c"):
            s.free(name)
    both(impl, ref, scenario, 8, 4, True)
    both(impl, ref, scenario, 4, 4, True, where="no free block left for the copy")


@pytest.mark.points(1)
def test_freed_blocks_stay_cached_until_reused(impl, ref):
    def scenario(s):
        s.allocate("a", range(12))
        s.step("a")
        s.free("a")
        s.allocate("b", range(8))         # finds a's first two blocks on the free list
        s.step("b")
        s.free("b")
        s.allocate("c", range(500, 520))  # takes every free block: a's cached contents are overwritten
        s.step("c")
        s.free("c")
        s.allocate("d", range(8))         # no hit any more
    both(impl, ref, scenario, 5, 4, True)

    def tight(s):
        s.allocate("a", range(8))
        s.step("a")
        s.free("a")                       # the free list is now [2, 1, 0]; blocks 1 and 0 hold a's tokens
        s.allocate("b", range(100, 104))  # takes block 2
        s.step("b")
        s.allocate("c", list(range(9)))   # 2 hits still on the free list + 1 fresh block > 2 free: refused
        s.allocate("d", range(8))         # 2 hits taken back from the free list, nothing fresh: fits
    both(impl, ref, tight, 3, 4, True, where="hits on the free list count against the free blocks")


def run_workload(manager_cls, seed):
    """A random workload through minillm's Scheduler with the given block manager; the trace of every step."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = rng.choice([12, 24, 64]) * (8 // block_size)
    bm = manager_cls(num_blocks, block_size, rng.random() < 0.8)
    sched = Scheduler(bm, max_num_seqs=rng.choice([2, 4, 8]), max_num_batched_tokens=rng.choice([5, 16, 256]))
    system = [rng.randrange(40) for _ in range(rng.randint(4, 24))]
    room = num_blocks * block_size - block_size
    for i in range(rng.randint(4, 12)):
        own = [rng.randrange(40) for _ in range(rng.randint(1, 16))]
        max_tokens = rng.randint(1, 12)
        prompt = (system + own if rng.random() < 0.6 else own)[: room - max_tokens]
        sched.add(seq(str(i), prompt, max_tokens))
    trace = []
    while sched.has_unfinished():
        out = sched.schedule()
        trace.append({"batch": [(s.request_id, n) for s, n in zip(out.seqs, out.num_new_tokens)],
                      "copies": out.block_copies, "preemptions": sched.num_preemptions,
                      **state(bm, sched.running)})
        assert out.seqs and len(trace) < 2000, "the workload is stuck"
        for s, n in zip(out.seqs, out.num_new_tokens):
            s.num_cached_tokens += n
            bm.commit(s)
            if s.num_cached_tokens == s.num_tokens:  # a next token, equal for equal contexts
                s.output_token_ids.append(sum(s.token_ids[-3:]) % 40)
                if len(s.output_token_ids) >= s.params.max_tokens:
                    sched.finish(s, "length")
    trace.append(state(bm, []))
    return trace


@pytest.mark.points(4)
def test_random_workloads_through_the_scheduler(impl, ref):
    for seed in range(16):
        want = run_workload(ref.BlockManager, seed)
        got = run_workload(impl.BlockManager, seed)
        for step, (g, w) in enumerate(zip(got, want), 1):
            for key in w:
                assert g.get(key) == w[key], f"workload {seed}, step {step}: {key} = {g.get(key)}, expected {w[key]}"
        assert len(got) == len(want), f"workload {seed}: {len(got) - 1} steps, expected {len(want) - 1}"


def paged_setup(seed, num_seqs, lengths, block_size, num_blocks, kv_heads, dim, dtype=torch.float32, pad=0):
    """A shuffled pool holding each sequence's K and V; the tables padded with `pad` extra zeros."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths[:num_seqs]]
    width = max(map(len, tables)) + pad
    return k_cache, v_cache, torch.tensor([t + [0] * (width - len(t)) for t in tables]), gen


@pytest.mark.points(2)
def test_gather_kv(impl, ref):
    cases = [([7, 13, 5], 4, 16, 3, 8, torch.float32, 0), ([1], 16, 4, 2, 16, torch.float32, 0),
             ([32, 16], 16, 8, 1, 4, torch.bfloat16, 2), ([9, 3, 20, 1], 1, 40, 4, 2, torch.float32, 3)]
    for seed, (lengths, bs, nb, heads, dim, dtype, pad) in enumerate(cases):
        k_cache, _, tables, _ = paged_setup(seed, len(lengths), lengths, bs, nb, heads, dim, dtype, pad)
        for row, n in zip(tables, lengths):
            got, want = impl.gather_kv(k_cache, row, n), ref.gather_kv(k_cache, row, n)
            where = f"length {n}, block_size {bs}, table {row.tolist()}, {dtype}"
            assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
            assert torch.equal(got, want), f"{where}: a gather copies values, they must be equal exactly"


DECODE_CASES = [  # lengths, block_size, num_blocks, heads, kv_heads, dim, pad
    ([7, 13, 5], 4, 16, 4, 2, 8, 0),
    ([1], 16, 4, 2, 2, 16, 0),
    ([30], 4, 12, 9, 3, 64, 1),
    ([9, 40, 2, 17], 8, 24, 6, 1, 32, 2),
    ([16, 16], 16, 4, 8, 8, 4, 0),
]


@pytest.mark.points(2)
def test_decode_attention_matches_reference(impl, ref):
    for seed, (lengths, bs, nb, heads, kv_heads, dim, pad) in enumerate(DECODE_CASES):
        k_cache, v_cache, tables, gen = paged_setup(seed, len(lengths), lengths, bs, nb, kv_heads, dim, pad=pad)
        q = torch.randn(len(lengths), heads, dim, generator=gen)
        lens, scale = torch.tensor(lengths), dim ** -0.5
        got = impl.decode_attention(q, k_cache, v_cache, tables, lens, scale)
        want = ref.decode_attention(q, k_cache, v_cache, tables, lens, scale)
        assert_close(got, want, atol=1e-5, rtol=1e-5,
                     msg=lambda m: f"context lengths {lengths}, {heads} heads / {kv_heads} KV heads: {m}")


@pytest.mark.points(1)
def test_decode_attention_equals_contiguous_attention(impl):
    lengths, bs, heads, kv_heads, dim = [5, 11, 3], 4, 6, 2, 16
    k_cache, v_cache, tables, gen = paged_setup(7, 3, lengths, bs, 12, kv_heads, dim, pad=1)
    q = torch.randn(3, heads, dim, generator=gen)
    got = impl.decode_attention(q, k_cache, v_cache, tables, torch.tensor(lengths), 0.3)
    for s, n in enumerate(lengths):
        k = torch.cat([k_cache[b] for b in tables[s].tolist()])[:n].repeat_interleave(heads // kv_heads, dim=1)
        v = torch.cat([v_cache[b] for b in tables[s].tolist()])[:n].repeat_interleave(heads // kv_heads, dim=1)
        weights = (torch.einsum("hd,nhd->hn", q[s], k) * 0.3).softmax(-1)
        assert_close(got[s], torch.einsum("hn,nhd->hd", weights, v), atol=1e-5, rtol=1e-5,
                     msg=lambda m: f"sequence {s} ({n} tokens) vs attention on its contiguous K/V: {m}")
