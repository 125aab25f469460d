"""Routing policies (no Ray): round robin cycles, least loaded, prefix affinity with its load guard, session
affinity by consistent hashing with the same guard; then the Ray Serve routers that wrap them, driven without a
cluster (loads from Serve's queue-length cache, or asked of the replicas through the public API)."""

import asyncio
import importlib.util
import random
from types import SimpleNamespace

import pytest

from minillm.block_manager import BlockManager
from minillm.metrics import RequestMetrics
from minillm.sampling import SamplingParams
from minillm.sequence import Sequence
from minillm.service.routing_policies import (LeastLoaded, PrefixAffinity, RoundRobin, RouteRequest,
                                              SessionAffinity, prefix_block_hashes)

REPLICAS = ["r0", "r1", "r2"]
IDLE = {r: 0 for r in REPLICAS}


def route(policy, request, loads=IDLE, replicas=REPLICAS) -> str:
    """Send a request where the policy ranks first, and tell the policy, as the Ray router does."""
    chosen = policy.rank(replicas, loads, request)[0]
    policy.record(chosen, request)
    return chosen


def prompt(system: int, user: int, system_len: int = 64, user_len: int = 12) -> RouteRequest:
    """A chat-shaped prompt: a system prompt shared by a tenant's users, then the user's own tokens."""
    return RouteRequest(tuple(1000 * system + i for i in range(system_len))
                        + tuple(100_000 + 50 * user + i for i in range(user_len)))


def test_round_robin_cycles_in_sorted_order():
    rr = RoundRobin()
    firsts = [rr.rank(["b", "c", "a"], {}, RouteRequest())[0] for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert sorted(rr.rank(["b", "c", "a"], {}, RouteRequest())) == ["a", "b", "c"]


def test_least_loaded_orders_by_load_and_shares_ties():
    ll = LeastLoaded()
    assert ll.rank(REPLICAS, {"r0": 5, "r1": 1, "r2": 3}, RouteRequest()) == ["r1", "r2", "r0"]
    assert ll.rank(REPLICAS, {"r0": 2, "r1": 7}, RouteRequest())[0] == "r2"  # a missing load counts as 0
    assert {ll.rank(REPLICAS, IDLE, RouteRequest())[0] for _ in range(3)} == set(REPLICAS)


def test_prefix_hashes_are_the_engine_prefix_cache_keys():
    tokens = list(range(37))
    bm = BlockManager(num_blocks=8, block_size=16)
    seq = Sequence("r", None, tokens, SamplingParams(), RequestMetrics(0.0))
    assert bm.allocate(seq)
    seq.num_cached_tokens = len(tokens)
    bm.commit(seq)
    assert prefix_block_hashes(tokens, 16) == seq.block_hashes and len(seq.block_hashes) == 2
    assert prefix_block_hashes(tokens[:15], 16) == []


def test_shared_prefixes_stick_and_different_prefixes_spread():
    policy = PrefixAffinity(block_size=16)
    homes = {s: route(policy, prompt(s, 0)) for s in range(3)}
    assert sorted(homes.values()) == REPLICAS  # three new system prompts: one per replica
    for user in range(1, 20):
        s = user % 3
        assert route(policy, prompt(s, user)) == homes[s], f"user {user} of tenant {s} left its prefix's replica"


def test_longest_match_wins_and_weak_matches_are_ignored():
    policy = PrefixAffinity(block_size=4, match_threshold=0.5)
    policy.record("r1", RouteRequest(tuple(range(8))))   # 2 blocks
    policy.record("r2", RouteRequest(tuple(range(16))))  # 4 blocks
    assert policy.rank(REPLICAS, IDLE, RouteRequest(tuple(range(20))))[0] == "r2"
    tie = RouteRequest(tuple(range(8)) + (99,) * 4)  # 2 of 3 blocks on r1 and r2 alike: the less loaded wins
    assert policy.rank(REPLICAS, {"r1": 2, "r2": 1}, tie)[0] == "r2"
    assert policy.rank(REPLICAS, IDLE, tie)[0] == "r1"  # equal loads: the smaller record
    weak = RouteRequest(tuple(range(4)) + (99,) * 28)  # 1 of 8 blocks matches: below the threshold
    assert policy.rank(REPLICAS, IDLE, weak)[0] == "r0"  # the least loaded, smallest record


def test_load_guard_leaves_an_overloaded_replica():
    policy = PrefixAffinity(block_size=16, balance_abs_threshold=4, balance_rel_threshold=1.5)
    home = route(policy, prompt(0, 0))
    others = [r for r in REPLICAS if r != home]
    busy = {home: 4, others[0]: 0, others[1]: 1}
    assert policy.rank(REPLICAS, busy, prompt(0, 1))[0] == home  # 4 more than the least: within the threshold
    overloaded = {home: 6, others[0]: 1, others[1]: 0}
    assert policy.rank(REPLICAS, overloaded, prompt(0, 1)) == [others[1], others[0], home]
    ratio_ok = {home: 20, others[0]: 15, others[1]: 14}  # 6 over the least, but not 1.5x
    assert policy.rank(REPLICAS, ratio_ok, prompt(0, 1))[0] == home


def test_hot_prefix_spreads_under_load_instead_of_piling_up():
    """One popular system prompt, requests arriving faster than they finish: the guard spreads them."""
    policy = PrefixAffinity(block_size=16, balance_abs_threshold=2, balance_rel_threshold=1.5)
    loads = dict(IDLE)
    for user in range(30):
        loads[route(policy, prompt(0, user), loads)] += 1
    assert max(loads.values()) - min(loads.values()) <= 3, loads
    guardless = PrefixAffinity(block_size=16, balance_abs_threshold=10**9)
    loads = dict(IDLE)
    for user in range(30):
        loads[route(guardless, prompt(0, user), loads)] += 1
    assert max(loads.values()) == 30  # prefix-only routing: every request on one replica


def test_record_is_bounded_and_keeps_shared_prefixes():
    policy = PrefixAffinity(block_size=4, capacity=10)
    shared = tuple(range(8))  # 2 blocks every prompt starts with
    for user in range(20):
        policy.record("r0", RouteRequest(shared + tuple(1000 + 8 * user + i for i in range(8))))
    record = policy.records["r0"]
    assert len(record) == 10
    assert policy.matched_blocks("r0", prefix_block_hashes(shared, 4)) == 2  # the tails were evicted first
    policy.retain({"r1"})
    assert policy.records == {}


def test_session_sticks_and_moves_only_the_users_of_a_leaving_replica():
    policy = SessionAffinity()
    four = ["r0", "r1", "r2", "r3"]
    users = [f"user-{i}" for i in range(400)]
    homes = {u: policy.rank(four, {}, RouteRequest(user=u))[0] for u in users}
    assert all(policy.rank(four, {"r0": 4}, RouteRequest((1, 2), user=u))[0] == homes[u] for u in users)
    assert all(60 <= list(homes.values()).count(r) <= 140 for r in four)  # about a quarter each
    three = ["r0", "r1", "r3"]
    after = {u: policy.rank(three, {}, RouteRequest(user=u))[0] for u in users}
    assert all(after[u] == homes[u] for u in users if homes[u] != "r2")  # only r2's users move
    moved_to = {u: policy.rank(four, {}, RouteRequest(user=u))[1] for u in users if homes[u] == "r2"}
    assert all(after[u] == moved_to[u] for u in moved_to)  # each to the next replica on its ring walk
    assert sorted(policy.rank(four, {}, RouteRequest(user="x"))) == four


def test_one_user_cannot_pin_its_requests_to_one_replica():
    """The prefix policy's load guard: past it, the user's requests go to the least loaded replica."""
    policy, loads = SessionAffinity(), dict(IDLE)
    for _ in range(300):
        loads[route(policy, RouteRequest(user="alice"), loads)] += 1
    assert max(loads.values()) <= 1.5 * min(loads.values()) + 1, loads  # not 300 on one: at most 1.5 x the least
    home = policy.rank(REPLICAS, IDLE, RouteRequest(user="alice"))[0]
    assert policy.rank(REPLICAS, {home: 4}, RouteRequest(user="alice"))[0] == home  # within the guard: sticks


def test_session_without_a_user_goes_to_the_least_loaded():
    policy = SessionAffinity()
    assert policy.rank(REPLICAS, {"r0": 3, "r1": 0, "r2": 2}, RouteRequest((1, 2, 3)))[0] == "r1"


def test_invalid_parameters_are_refused():
    with pytest.raises(ValueError, match="block_size"):
        PrefixAffinity(block_size=0)
    with pytest.raises(ValueError, match="virtual_nodes"):
        SessionAffinity(virtual_nodes=0)


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray[serve] is not installed")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Serve's own pydantic fields
def test_ray_routers_rank_and_learn_without_a_cluster():
    """Each router is a Ray Serve RequestRouter that Serve can build with its own arguments; fed replicas with
    cached queue lengths, it returns one tier per replica in its policy's order and learns from routed requests."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
    from ray.serve.request_router import PendingRequest, RequestRouter

    from minillm.engine_args import EngineArgs
    from minillm.service.routers import ROUTERS, LeastLoadedRouter, PrefixAffinityRouter, request_router_config

    assert set(ROUTERS) == {"round_robin", "least_loaded", "prefix", "session"}
    assert request_router_config("least_loaded", EngineArgs()).request_router_class == \
        "minillm.service.routers.LeastLoadedRouter"  # the policy, not Serve's power of two choices
    config = request_router_config("prefix", EngineArgs(block_size=32, num_kv_blocks=300))
    assert config.request_router_kwargs == {"block_size": 32, "capacity": 300}  # the engine's blocks and pool
    with pytest.raises(ValueError, match="not one of"):
        request_router_config("random", EngineArgs())
    deployment = DeploymentID(name="engine", app_name="minillm")
    routers = {name: cls(deployment_id=deployment, handle_source=DeploymentHandleSource.UNKNOWN,
                         use_replica_queue_len_cache=True) for name, cls in ROUTERS.items()}
    for name, router in routers.items():
        assert isinstance(router, RequestRouter), name
        router.initialize_state(**({"block_size": 16} if name == "prefix" else {}))
    asked = []

    def queue_len(n: int):
        async def get_queue_len(deadline_s: float) -> int:
            asked.append(n)
            return n
        return get_queue_len

    replicas = [SimpleNamespace(replica_id=ReplicaID(f"r{i}", deployment), max_ongoing_requests=8,
                                get_queue_len=queue_len(n)) for i, n in enumerate((5, 2, 7))]

    def pending(req: RouteRequest) -> PendingRequest:
        meta = RequestMetadata(request_id="x", internal_request_id=str(random.random()))
        return PendingRequest(args=[], kwargs={"prompt_token_ids": list(req.prompt_token_ids), "user": req.user},
                              metadata=meta)

    async def choose(router, req: RouteRequest) -> list[str]:
        tiers = await router.choose_replicas(replicas, pending(req))
        assert all(len(tier) == 1 for tier in tiers)
        return [tier[0].replica_id.unique_id for tier in tiers]

    async def scenario() -> None:
        assert await choose(routers["least_loaded"], RouteRequest()) == ["r1", "r0", "r2"]  # asked: 5, 2, 7
        assert sorted(asked) == [2, 5, 7]
        assert await choose(routers["least_loaded"], RouteRequest()) == ["r1", "r0", "r2"]
        assert len(asked) == 3  # the second time from the cache the answers went into
        for router in routers.values():
            for r, n in zip(replicas, (3, 0, 1)):
                router.replica_queue_len_cache.update(r.replica_id, n)
        assert await choose(routers["round_robin"], prompt(0, 0)) == ["r0", "r1", "r2"]
        assert await choose(routers["round_robin"], prompt(0, 0)) == ["r1", "r2", "r0"]
        assert await choose(routers["least_loaded"], RouteRequest()) == ["r1", "r2", "r0"]
        prefix: PrefixAffinityRouter = routers["prefix"]
        assert (await choose(prefix, prompt(0, 0)))[0] == "r1"  # nothing cached anywhere: the least loaded
        prefix.on_request_routed(pending(prompt(0, 0)), replicas[2].replica_id, None)
        assert (await choose(prefix, prompt(0, 1)))[0] == "r2"  # r2 has the prefix and is not overloaded
        first = await choose(routers["session"], RouteRequest((), "alice"))
        assert await choose(routers["session"], RouteRequest((5,), "alice")) == first

    asyncio.run(scenario())


def test_router_options_reach_the_policy_and_a_wrong_one_is_named():
    from minillm.engine_args import EngineArgs
    from minillm.service.routers import request_router_config
    config = request_router_config("session", EngineArgs(), {"balance_abs_threshold": 10**6})
    assert config.request_router_kwargs["balance_abs_threshold"] == 10**6
    with pytest.raises(TypeError, match="balance_abs"):
        request_router_config("round_robin", EngineArgs(), {"balance_abs_threshold": 1})
