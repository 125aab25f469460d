"""Grader for exercise 9: your block hashes against the engine's prefix-cache keys; your prefix-affinity ranking,
load guard and bounded record against minillm's, rule by rule and then over random multi-tenant workloads."""

import random

import pytest

REPLICAS = ["r0", "r1", "r2"]
IDLE = {r: 0 for r in REPLICAS}


def tokens_of(tenant: int, user: int, system_len: int = 48, user_len: int = 8) -> tuple[int, ...]:
    """A chat-shaped prompt: the tenant's system prompt, shared by all its users, then the user's own tokens."""
    return tuple(1000 * tenant + i for i in range(system_len)) + tuple(100_000 + 37 * user + i for i in range(user_len))


def route(policy, request, loads=IDLE, replicas=REPLICAS) -> str:
    """Send the request where the policy ranks first and record it there, as the Ray router does."""
    chosen = policy.rank(replicas, loads, request)[0]
    policy.record(chosen, request)
    return chosen


def record_of(policy, replica: str) -> list[bytes]:
    return list(policy.records.get(replica, ()))


@pytest.mark.points(2)
def test_prefix_block_hashes(impl, ref):
    for block_size in (1, 4, 16):
        for n in (0, 3, 15, 16, 17, 37, 64):
            tokens = [(7 * i) % 11 for i in range(n)]  # repeating content: the chaining must tell blocks apart
            got, want = impl.prefix_block_hashes(tokens, block_size), ref.prefix_block_hashes(tokens, block_size)
            assert got == want, (f"prefix_block_hashes of {n} tokens, block_size {block_size}: {len(got)} hashes, "
                                 f"expected {len(want)}" + ("" if len(got) != len(want) else "; the hashes differ"))


@pytest.mark.points(1)
def test_parameters(impl, ref):
    p = impl.PrefixAffinity()
    for name in ("block_size", "capacity", "match_threshold", "balance_abs_threshold", "balance_rel_threshold"):
        assert getattr(p, name) == getattr(ref.PrefixAffinity(), name), f"default {name} is {getattr(p, name)!r}"
    for bad in ({"block_size": 0}, {"capacity": 0}):
        with pytest.raises(ValueError):
            impl.PrefixAffinity(**bad)
            pytest.fail(f"PrefixAffinity(**{bad}) did not raise ValueError")


@pytest.mark.points(1)
def test_matched_blocks(impl, ref):
    p = impl.PrefixAffinity(block_size=4)
    p.record("r1", ref.RouteRequest(tuple(range(16))))
    hashes = ref.prefix_block_hashes
    cases = [("r1", list(range(20)), 4), ("r1", list(range(8)) + [99] * 8, 2), ("r1", [99] + list(range(1, 16)), 0),
             ("r0", list(range(16)), 0), ("r1", list(range(3)), 0)]
    for replica, tokens, want in cases:
        got = p.matched_blocks(replica, hashes(tokens, 4))
        assert got == want, f"matched_blocks({replica!r}, hashes of {tokens}) = {got}, expected {want}"
    gap = [b"\0" * 32] + hashes(list(range(16)), 4)  # a first hash the record lacks: nothing matches after it
    assert p.matched_blocks("r1", gap) == 0, "matched_blocks counted hashes after the first one the record lacks"


@pytest.mark.points(2)
def test_overloaded(impl, ref):
    p = impl.PrefixAffinity(balance_abs_threshold=4, balance_rel_threshold=1.5)
    cases = [({"r0": 4, "r1": 0, "r2": 2}, False),    # 4 over the least: not more than 4
             ({"r0": 5, "r1": 0, "r2": 2}, True),     # 5 over, and 5 > 1.5 x 0
             ({"r0": 15, "r1": 10, "r2": 12}, False),  # 5 over, but 15 is not more than 1.5 x 10
             ({"r0": 16, "r1": 10, "r2": 10}, True), ({"r0": 5}, True),  # r1 and r2 missing: load 0
             ({"r0": 15, "r1": 10}, True),  # r2 missing: the least is 0
             ({"r0": 5, "r1": 5, "r2": 5}, False), ({"r1": 9}, False)]  # the least loaded is never overloaded
    for loads, want in cases:
        got = p.overloaded("r0", loads, REPLICAS)
        assert got == want, f"overloaded('r0', {loads}, {REPLICAS}) = {got}, expected {want}"
    assert impl.PrefixAffinity(balance_abs_threshold=0, balance_rel_threshold=1.0).overloaded(
        "r0", {"r0": 2, "r1": 1, "r2": 1}, REPLICAS), "thresholds 0 and 1.0: any load above the least is overloaded"


@pytest.mark.points(2)
def test_new_prefixes_go_to_the_least_loaded_and_spread(impl, ref):
    p = impl.PrefixAffinity(block_size=16)
    got = p.rank(REPLICAS, {"r0": 3, "r1": 1, "r2": 2}, ref.RouteRequest(tokens_of(0, 0)))
    assert got == ["r1", "r2", "r0"], f"nothing recorded, loads 3, 1, 2: ranked {got}, expected ['r1', 'r2', 'r0']"
    homes = [route(p, ref.RouteRequest(tokens_of(t, 0))) for t in range(3)]
    assert sorted(homes) == REPLICAS, f"three new system prompts on idle replicas went to {homes}: ties must go to " \
                                      "the replica with the smallest record, so new prefixes spread"
    got = p.rank(["r2", "r0", "r1"], {}, ref.RouteRequest(tokens_of(9, 0)))
    assert got == ["r2", "r0", "r1"], f"equal loads and record sizes: ranked {got}, expected the order given, " \
                                      "['r2', 'r0', 'r1']"


@pytest.mark.points(2)
def test_a_shared_prefix_sticks_to_its_replica(impl, ref):
    p = impl.PrefixAffinity(block_size=16)
    homes = {t: route(p, ref.RouteRequest(tokens_of(t, 0))) for t in range(3)}
    for user in range(1, 30):
        tenant = user % 3
        loads = {r: random.Random(user).randrange(3) for r in REPLICAS}  # imbalance within the thresholds
        got = route(p, ref.RouteRequest(tokens_of(tenant, user)), loads)
        assert got == homes[tenant], f"user {user} of tenant {tenant} went to {got}, not to {homes[tenant]}, " \
                                     f"which holds the tenant's system prompt (loads {loads})"


@pytest.mark.points(2)
def test_longest_match_wins_above_the_threshold(impl, ref):
    p, q = (m.PrefixAffinity(block_size=4, match_threshold=0.5) for m in (impl, ref))
    for policy in (p, q):
        policy.record("r1", ref.RouteRequest(tuple(range(8))))   # 2 blocks
        policy.record("r2", ref.RouteRequest(tuple(range(16))))  # 4 blocks
    two_of_three = tuple(range(8)) + (99,) * 4
    cases = [(tuple(range(20)), IDLE, "r2", "r2 holds 4 of its 5 blocks, r1 only 2"),
             (two_of_three, {"r1": 2, "r2": 1}, "r2", "r1 and r2 both hold 2 of 3 blocks: the less loaded"),
             (two_of_three, IDLE, "r1", "r1 and r2 both hold 2 of 3 blocks, equal loads: the smaller record"),
             (tuple(range(8)) + (99,) * 8, IDLE, "r1", "2 of 4 blocks: exactly the threshold, which is enough"),
             (tuple(range(4)) + (99,) * 28, IDLE, "r0", "1 of 8 blocks: below the threshold, so the least loaded"),
             (tuple(range(3)), IDLE, "r0", "no full block: the least loaded")]
    for tokens, loads, want, why in cases:
        got = p.rank(REPLICAS, loads, ref.RouteRequest(tokens))
        expected = q.rank(REPLICAS, loads, ref.RouteRequest(tokens))
        assert got[0] == want and got == expected, f"{len(tokens)} tokens, loads {loads}: ranked {got}, expected " \
                                                   f"{expected} ({why})"


@pytest.mark.points(2)
def test_the_load_guard(impl, ref):
    p = impl.PrefixAffinity(block_size=16, balance_abs_threshold=4, balance_rel_threshold=1.5)
    home = route(p, ref.RouteRequest(tokens_of(0, 0)))
    a, b = [r for r in REPLICAS if r != home]
    cases = [({home: 4, a: 0, b: 1}, [home, a, b], "4 over the least: not overloaded"),
             ({home: 6, a: 1, b: 0}, [b, a, home], "6 over the least: overloaded, so the least-loaded order"),
             ({home: 20, a: 15, b: 14}, [home, b, a], "6 over the least but not 1.5 times it: not overloaded")]
    for loads, want, why in cases:
        got = p.rank(REPLICAS, loads, ref.RouteRequest(tokens_of(0, 1)))
        assert got == want, f"loads {loads}, the prefix on {home}: ranked {got}, expected {want} ({why})"
    hot = impl.PrefixAffinity(block_size=16, balance_abs_threshold=2, balance_rel_threshold=1.5)
    loads = dict(IDLE)
    for user in range(30):  # one popular system prompt, requests arriving faster than they finish
        loads[route(hot, ref.RouteRequest(tokens_of(0, user)), loads)] += 1
    assert max(loads.values()) - min(loads.values()) <= 3, f"one hot prefix piled up: requests per replica {loads}"


@pytest.mark.points(2)
def test_the_record_is_bounded_and_keeps_shared_prefixes(impl, ref):
    p = impl.PrefixAffinity(block_size=4, capacity=10)
    shared = tuple(range(8))  # 2 blocks every prompt starts with
    for user in range(20):
        p.record("r0", ref.RouteRequest(shared + tuple(1000 + 8 * user + i for i in range(8))))
        q = ref.PrefixAffinity(block_size=4, capacity=10)
        for u in range(user + 1):
            q.record("r0", ref.RouteRequest(shared + tuple(1000 + 8 * u + i for i in range(8))))
        got, want = record_of(p, "r0"), record_of(q, "r0")
        assert len(got) == len(want), f"after {user + 1} prompts of 4 blocks, capacity 10: the record holds " \
                                      f"{len(got)} hashes, expected {len(want)}"
        assert got == want, f"after {user + 1} prompts: the record's hashes or their order (oldest first) differ"
    first = ref.prefix_block_hashes(shared, 4)[0]
    assert record_of(p, "r0")[-1] == first, "the newest hash must be the prompt's first block"
    assert p.matched_blocks("r0", ref.prefix_block_hashes(shared, 4)) == 2, "the shared prefix was evicted"


@pytest.mark.points(1)
def test_rank_returns_every_replica_once_and_changes_nothing(impl, ref):
    p = impl.PrefixAffinity(block_size=16)
    route(p, ref.RouteRequest(tokens_of(0, 0)))
    before = {r: record_of(p, r) for r in REPLICAS}
    for replicas in (["r2", "r0", "r1"], ["r1"], ["r0", "r2"]):
        got = p.rank(replicas, {"r1": 3}, ref.RouteRequest(tokens_of(1, 1)))
        assert sorted(got) == sorted(replicas), f"rank over {replicas} returned {got}"
    assert {r: record_of(p, r) for r in REPLICAS} == before, "rank changed a record"


@pytest.mark.points(3)
def test_random_workloads_match_minillm(impl, ref):
    """Tenants with system prompts of different lengths (some sharing a beginning), users with follow-up turns,
    random loads, replicas joining the ranking in random order: every ranking and record equal to minillm's."""
    for seed in range(8):
        rng = random.Random(seed)
        params = dict(block_size=rng.choice([2, 4, 8]), capacity=rng.choice([6, 20, 200]),
                      match_threshold=rng.choice([0.0, 0.3, 0.5, 1.0]), balance_abs_threshold=rng.randrange(4),
                      balance_rel_threshold=rng.choice([1.0, 1.5, 3.0]))
        p, q = impl.PrefixAffinity(**params), ref.PrefixAffinity(**params)
        names = [f"replica-{i}" for i in range(rng.randrange(2, 5))]
        systems = [tuple(rng.randrange(50) for _ in range(rng.randrange(0, 40))) for _ in range(4)]
        systems.append(systems[0][:10] + (7,) * 12)  # shares a beginning with another tenant
        for step in range(150):
            tokens = rng.choice(systems) + tuple(rng.randrange(50) for _ in range(rng.randrange(0, 12)))
            request = ref.RouteRequest(tokens)
            replicas = rng.sample(names, rng.randrange(1, len(names) + 1))
            loads = {r: rng.randrange(8) for r in names if rng.random() < 0.9}
            got, want = p.rank(replicas, loads, request), q.rank(replicas, loads, request)
            assert got == want, (f"seed {seed}, step {step}, parameters {params}: ranked {got}, expected {want} "
                                 f"(loads {loads}, {len(tokens)} tokens)")
            chosen = rng.choice(want)  # where Serve sent it: usually the first, not always
            p.record(chosen, request)
            q.record(chosen, request)
            assert record_of(p, chosen) == record_of(q, chosen), \
                f"seed {seed}, step {step}, parameters {params}: {chosen}'s record differs after record()"
