"""The KV offload tier (chapter 10): prefix-cache blocks the pool evicts go to a second tier and come back instead of
being recomputed. A conversation that returns after its blocks were evicted reloads them, runs exactly that many
fewer prompt tokens through the model, and answers token for token as an engine without the tier does (float32 and
int8 pools, file and host memory); a corrupted slot is refused, counted and recomputed; a full tier reuses its least
recently used slots but never one about to be reloaded; bad arguments are refused by name; /metrics counts it all."""

import random

import httpx
import pytest
import torch

from minillm import LLM, LLMEngine, SamplingParams
from minillm.__main__ import build_parser
from minillm.block_manager import block_hash
from minillm.config import ModelConfig
from minillm.engine_args import EngineArgs
from minillm.kv_cache import KVCache
from minillm.kv_handoff import KVLayout
from minillm.kv_offload import GIB, HEADER_BYTES, KVOffloadTier, slot_bytes, time_tier

BLOCK = 4
ENGINE = dict(device="cpu", dtype=torch.float32, block_size=BLOCK, num_kv_blocks=16)  # 64 tokens: a few prompts
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
ROOMY = 1 / 1024  # GiB: hundreds of the tiny model's slots
A_BLOCKS = 7  # A's first turn: 24 prompt tokens and 6 generated, 29 of them computed, so 7 full blocks hashed


def ids(seed: int, n: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


class Counted:
    """Wraps an engine's model runner to count the tokens each forward pass runs."""

    def __init__(self, engine: LLMEngine):
        self.run, self.tokens = engine.runner.run, 0
        engine.runner.run = self

    def __call__(self, step):
        self.tokens += sum(step.num_new_tokens)
        return self.run(step)


def conversation(llm: LLM, before_return=None) -> tuple[list[list[int]], dict]:
    """Conversation A's first turn, two other prompts (the second evicts every block of A), then A's second turn
    (the first turn, its reply, six more tokens). Returns every output's tokens and, over the second turn, the
    change of each stats counter and the tokens the model ran (`tokens_run`). `before_return(llm, second_turn)`
    runs just before the second turn."""
    first = ids(0)
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in (first, ids(1), ids(2))]
    second = first + outs[0] + ids(3, 6)
    if before_return is not None:
        before_return(llm, second)
    counted, before = Counted(llm.engine), llm.stats()
    outs.append(llm.generate([second], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    after = llm.stats()
    delta = {k: after[k] - before[k] for k in after if isinstance(after[k], int) and k in before}
    return outs, {**delta, "tokens_run": counted.tokens}


@pytest.fixture(scope="module")
def baseline(tiny_llama):
    """The conversation on engines without a tier, one per KV cache dtype (cached)."""
    runs = {}

    def run(kv_cache_dtype: str = "auto", **engine):
        key = (kv_cache_dtype, tuple(sorted(engine.items())))
        if key not in runs:
            runs[key] = conversation(LLM(tiny_llama, kv_cache_dtype=kv_cache_dtype, **{**ENGINE, **engine}))
        return runs[key]
    return run


def a_hashes(second_turn: list[int]) -> list[bytes]:
    """The chained hashes of A's full computed blocks (those the tier may hold)."""
    hashes, prev = [], None
    for i in range(A_BLOCKS):
        prev = block_hash(prev, tuple(second_turn[i * BLOCK:(i + 1) * BLOCK]))
        hashes.append(prev)
    return hashes


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("kv_cache_dtype, backend", [("auto", "file"), ("auto", "host"), ("int8", "native")])
def test_a_returning_conversation_reloads_its_blocks_and_answers_the_same(tiny_llama, baseline, cache_dir,
                                                                         kv_cache_dtype, backend):
    llm = LLM(tiny_llama, kv_cache_dtype=kv_cache_dtype, kv_offloading_size=ROOMY, kv_offloading_backend=backend,
              **ENGINE)
    tier = llm.engine.kv_offload
    assert tier.backend == ("host" if backend == "host" else "file")
    assert (tier.path is not None and tier.path.parent == cache_dir / "kv_offload") == (tier.backend == "file")
    outs, delta = conversation(llm)
    want, plain = baseline(kv_cache_dtype)
    assert outs == want
    assert plain["prefix_cache_hit_tokens"] == 0  # without the tier, every block of A was evicted and recomputed
    assert delta["kv_offload_blocks_loaded"] == A_BLOCKS and delta["kv_offload_load_failures"] == 0
    assert delta["prefix_cache_hit_tokens"] == A_BLOCKS * BLOCK  # counted as cached, as a hit in the pool is
    assert plain["tokens_run"] - delta["tokens_run"] == A_BLOCKS * BLOCK  # and not run through the model
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["kv_offload_blocks_stored"] >= A_BLOCKS
    assert stats["kv_offload_bytes_used"] == len(tier.slots) * tier.slot_bytes > 0
    assert stats["kv_offload_bytes_total"] == tier.num_slots * tier.slot_bytes <= ROOMY * GIB
    llm.reset_prefix_cache()  # forgets the tier's blocks too
    assert llm.stats()["kv_offload_bytes_used"] == 0
    llm.shutdown()
    assert tier.path is None or not tier.path.exists()


@pytest.mark.parametrize("where", ["bytes", "hash"])
def test_a_corrupted_slot_is_refused_counted_and_recomputed(tiny_llama, baseline, cache_dir, where):
    """A flipped byte of A's third block in the file (in its keys and values, or in the hash its header names): the
    first two blocks reload, the third is refused and it and the rest are computed, and the answer is unchanged."""
    def corrupt(llm, second_turn):
        tier = llm.engine.kv_offload
        offset = tier.slots[a_hashes(second_turn)[2]] * tier.slot_bytes + (HEADER_BYTES + 5 if where == "bytes" else 11)
        with open(tier.path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ 0x40]))

    llm = LLM(tiny_llama, kv_offloading_size=ROOMY, kv_offloading_backend="file", **ENGINE)
    outs, delta = conversation(llm, corrupt)
    want, plain = baseline()
    assert outs == want
    assert delta["kv_offload_load_failures"] == 1 and delta["kv_offload_blocks_loaded"] == 2
    assert delta["prefix_cache_hit_tokens"] == 2 * BLOCK
    assert plain["tokens_run"] - delta["tokens_run"] == 2 * BLOCK
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_a_full_tier_reuses_its_least_recently_used_slots(tiny_llama, baseline, cache_dir):
    """Three slots: A's blocks are evicted last block first, so the tier ends up holding A's first three; the other
    prompts' blocks evicted while A returns may not displace them."""
    c = ModelConfig.from_dir(tiny_llama)
    size = 3 * slot_bytes(KVLayout(BLOCK, c.num_layers, c.num_kv_heads, c.head_dim, "float32", False)) / GIB
    llm = LLM(tiny_llama, kv_offloading_size=size, kv_offloading_backend="file", **ENGINE)
    tier = llm.engine.kv_offload
    assert tier.num_slots == 3
    outs, delta = conversation(llm)
    want, plain = baseline()
    assert outs == want
    assert delta["kv_offload_blocks_loaded"] == 3 and delta["prefix_cache_hit_tokens"] == 3 * BLOCK
    assert plain["tokens_run"] - delta["tokens_run"] == 3 * BLOCK
    stats = llm.stats()
    assert stats["kv_offload_blocks_stored"] > 3  # slots were reused
    assert stats["kv_offload_bytes_used"] == stats["kv_offload_bytes_total"] == 3 * tier.slot_bytes
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_the_tier_evicts_least_recently_used_and_keeps_what_is_about_to_be_reloaded():
    torch.manual_seed(0)
    pool = KVCache(torch.randn(2, 8, BLOCK, 2, 16), torch.randn(2, 8, BLOCK, 2, 16))
    block3, block6 = pool.pack_blocks([3]), pool.pack_blocks([6])
    tier = KVOffloadTier(pool, 3 * slot_bytes(KVLayout.of(pool)), "host")
    h = [bytes([i]) * 32 for i in range(6)]
    for i in range(4):
        tier.store(h[i], i)
    assert [tier.lookup(x) for x in h[:4]] == [False, True, True, True]  # h0 went first
    assert tier.lookup(h[1])  # touched last: h2 is now the least recently used
    tier.store(h[4], 4)
    assert not tier.lookup(h[2]) and tier.lookup(h[4])
    tier.store(h[5], 5, keep={h[1], h[3], h[4]})  # every slot is about to be reloaded: h5 is not stored
    assert not tier.lookup(h[5]) and tier.num_stored == 5
    assert tier.load(h[3], 7) and not tier.load(h[0], 6)
    assert torch.equal(pool.pack_blocks([7]), block3) and torch.equal(pool.pack_blocks([6]), block6)
    assert (tier.num_loaded, tier.num_failed) == (1, 0)


@pytest.mark.parametrize("bad, says", [({"kv_offloading_size": -1.0}, "kv_offloading_size must be a positive"),
                                       ({"kv_offloading_size": 0}, "kv_offloading_size must be a positive"),
                                       ({"kv_offloading_size": float("nan")}, "kv_offloading_size must be a positive"),
                                       ({"kv_offloading_size": "1"}, "kv_offloading_size must be a positive"),
                                       ({"kv_offloading_size": True}, "kv_offloading_size must be a positive"),
                                       ({"kv_offloading_backend": "disk"}, "kv_offloading_backend 'disk'")])
def test_bad_arguments_are_refused_by_name_before_anything_loads(bad, says):
    with pytest.raises(ValueError, match=says):
        LLMEngine("/no/such/model", **bad)


@pytest.mark.parametrize("extra, says", [({"enable_prefix_caching": False}, "kv_offloading_size needs enable_prefix"),
                                         ({"tensor_parallel_size": 2}, "kv_offloading_size is not supported with"),
                                         ({"kv_offloading_size": 1e-9}, "kv_offloading_size .* holds no block")])
def test_what_the_tier_cannot_do_is_refused_by_name(tiny_llama, cache_dir, extra, says):
    with pytest.raises(ValueError, match=says):
        LLMEngine(tiny_llama, **{**ENGINE, "kv_offloading_size": ROOMY, **extra})
    assert not list(cache_dir.rglob("kv-offload-*"))


def test_command_lines_take_the_tier_flags(capsys):
    args = build_parser().parse_args(["serve", "--kv-offloading-size", "0.5", "--kv-offloading-backend", "file"])
    assert EngineArgs.from_cli_args(args) == EngineArgs(kv_offloading_size=0.5, kv_offloading_backend="file")
    from minillm.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--model", "/nonexistent", "--kv-offloading-size", "-2"])
    assert e.value.code == 2 and "kv_offloading_size must be a positive" in capsys.readouterr().err


def test_metrics_count_offloaded_reloaded_and_refused_blocks(tiny_llama, cache_dir):
    from serving_utils import scrape, serve_engine

    engine = LLMEngine(tiny_llama, kv_offloading_size=ROOMY, **ENGINE)
    first = ids(0)
    with serve_engine(engine) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        def complete(prompt):
            body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
            assert c.post("/v1/completions", json=body).status_code == 200
        for prompt in (first, ids(1), ids(2), first + ids(3, 6)):  # A, two that evict it, A with more
            complete(prompt)
        metrics = scrape(c)
    assert metrics["kv_offload_blocks_stored_total"] >= A_BLOCKS
    assert metrics["kv_offload_blocks_loaded_total"] == 6  # A's 24 prompt tokens: six blocks come back
    assert metrics["kv_offload_load_failures_total"] == 0
    assert metrics["kv_offload_bytes_used"] == engine.stats()["kv_offload_bytes_used"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_on_a_gpu_the_tier_is_pinned_host_memory(tiny_llama, baseline, cache_dir):
    gpu = {"device": "cuda"}
    llm = LLM(tiny_llama, kv_offloading_size=ROOMY, **{**ENGINE, **gpu})
    tier = llm.engine.kv_offload
    assert tier.backend == "host" and tier.path is None and tier.buffer.is_pinned()
    outs, delta = conversation(llm)
    want, plain = baseline(**gpu)
    assert outs == want and plain["prefix_cache_hit_tokens"] == 0
    assert delta["kv_offload_blocks_loaded"] == A_BLOCKS and delta["prefix_cache_hit_tokens"] == A_BLOCKS * BLOCK


def test_timing_the_tier_stores_and_reloads_every_block(tiny_llama, cache_dir):
    timed = time_tier(ModelConfig.from_dir(tiny_llama), 4, 8, "file")
    assert set(timed) == {"store_s", "load_s", "read_bytes_s"} and all(v > 0 for v in timed.values())
