"""Chapter 9 — Ray Serve request routers: the policies of `routing_policies.py` deciding which replica gets a request.

Serve calls `choose_replicas` with the replicas it may use and the pending request, whose keyword arguments
(those the ingress passes to a replica) hold `prompt_token_ids` and `user`. A router returns tiers of
replicas, best first; Serve sends the request to the least-loaded replica of the first tier that has room
and moves on to the next tier when all of it is full. So each router returns one tier per replica, in its
policy's order. Loads are Serve's own counts of requests in flight per replica, read through the request
router's public API (its queue-length cache, and a replica's `get_queue_len` where the cache has no fresh
count). `ROUTERS` maps the names of `serve --router` to a class for
`RequestRouterConfig(request_router_class=...)`; without `--router`, Serve's default routes: power of two
choices (two replicas at random, the less loaded wins). `request_router_config` builds that config with what
the policy must know of the engine (its block size and KV pool).
"""

from __future__ import annotations

import asyncio

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ..engine_args import EngineArgs
from .routing_policies import LeastLoaded, PrefixAffinity, RoundRobin, RouteRequest, RoutingPolicy, SessionAffinity

PROBE_S = 1.0  # how long a replica may take to tell its queue length; past it, its load counts as unknown (0)


def route_request(pending_request: PendingRequest | None) -> RouteRequest:
    """The prompt's token ids and the user, from the keyword arguments the ingress passed to the replica."""
    kwargs = pending_request.kwargs if pending_request is not None else {}
    return RouteRequest(tuple(kwargs.get("prompt_token_ids") or ()), kwargs.get("user"))


class PolicyRouter(RequestRouter):
    """A request router that ranks replicas with a `RoutingPolicy`, built from `request_router_kwargs`."""

    policy_class: type[RoutingPolicy]

    @staticmethod
    def engine_kwargs(engine_args: EngineArgs) -> dict:
        """The policy's keyword arguments that come from the replicas' engine (none by default)."""
        return {}

    def initialize_state(self, **kwargs) -> None:
        self.policy = self.policy_class(**kwargs)

    async def loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Requests in flight per replica: Serve's cached counts, asking the replicas it has no fresh count for
        (their answers go into the cache, as Serve's own probes do)."""
        cache = self.replica_queue_len_cache
        loads = {r.replica_id.unique_id: n for r in replicas if (n := cache.get(r.replica_id)) is not None}
        unknown = [r for r in replicas if r.replica_id.unique_id not in loads]
        answers = await asyncio.gather(*(asyncio.wait_for(r.get_queue_len(deadline_s=PROBE_S), PROBE_S)
                                         for r in unknown), return_exceptions=True)
        for r, n in zip(unknown, answers):
            if isinstance(n, int):  # not an error or a timeout (a dying replica)
                self.on_new_queue_len_info(r.replica_id, n)
                loads[r.replica_id.unique_id] = n
        return loads

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranking = self.policy.rank(list(by_id), await self.loads(candidate_replicas), route_request(pending_request))
        return [[by_id[r]] for r in ranking]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: object) -> None:
        self.policy.record(replica_id.unique_id, route_request(pending_request))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.policy.retain({r.replica_id.unique_id for r in replicas})


class RoundRobinRouter(PolicyRouter):
    """Each replica in turn, whatever its load or cache: the baseline the others are measured against."""

    policy_class = RoundRobin


class LeastLoadedRouter(PolicyRouter):
    """The replica with the fewest requests in flight, ties in turn: every replica compared, not two at random."""

    policy_class = LeastLoaded


class PrefixAffinityRouter(PolicyRouter):
    """To the replica holding the longest prefix of the prompt, unless it is overloaded (kwargs: `PrefixAffinity`'s)."""

    policy_class = PrefixAffinity

    @staticmethod
    def engine_kwargs(engine_args: EngineArgs) -> dict:
        """Hash the engine's blocks; record at most a KV pool's worth of them per replica, when its size is set."""
        return {"block_size": engine_args.block_size,
                **({"capacity": engine_args.num_kv_blocks} if engine_args.num_kv_blocks else {})}


class SessionAffinityRouter(PolicyRouter):
    """A user's requests to one replica by consistent hashing, unless it is overloaded; requests without a user to
    the least loaded (kwargs: `SessionAffinity`'s)."""

    policy_class = SessionAffinity


ROUTERS: dict[str, type[PolicyRouter]] = {
    "round_robin": RoundRobinRouter,
    "least_loaded": LeastLoadedRouter,
    "prefix": PrefixAffinityRouter,
    "session": SessionAffinityRouter,
}


def request_router_config(name: str, engine_args: EngineArgs, options: dict | None = None) -> RequestRouterConfig:
    """Serve's config for router `name` of `ROUTERS` over replicas of this engine; `options` go to its policy
    (a TypeError here, naming the keyword, if the policy has no such parameter)."""
    if name not in ROUTERS:
        raise ValueError(f"router {name!r} is not one of {', '.join(ROUTERS)}")
    cls = ROUTERS[name]
    kwargs = {**cls.engine_kwargs(engine_args), **(options or {})}
    cls.policy_class(**kwargs)  # a wrong keyword fails here, not in Serve's router process
    return RequestRouterConfig(request_router_class=cls, request_router_kwargs=kwargs)
