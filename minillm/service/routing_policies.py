"""Chapter 9 — routing policies: which replica should serve a request, ranked best first.

Each policy is plain Python over replica ids and their loads (requests queued or running), so it can be
unit-tested and graded without a cluster; `routers.py` wraps each in a Ray Serve request router. The
prefix policy predicts each replica's prefix cache the way SGLang's router does (an approximate, bounded
record of what it was sent) and, like SGLang and Ray's prefix-cache affinity router, gives up the cache
hit when the replica it points at is overloaded: prefix-only routing piles a popular prefix on one replica.
The session policy keeps the same guard, so that one user cannot pin hundreds of requests to one replica.
"""

from __future__ import annotations

import bisect
import hashlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from ..block_manager import block_hash


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may look at: the prompt's token ids (chat template applied) and the OpenAI `user` field."""

    prompt_token_ids: Sequence[int] = ()
    user: str | None = None


class RoutingPolicy(ABC):
    """Ranks the replicas for one request; may learn from where requests went."""

    @abstractmethod
    def rank(self, replicas: Sequence[str], loads: Mapping[str, int], request: RouteRequest) -> list[str]:
        """Every replica in `replicas`, the preferred first; `loads`: each one's requests in flight (missing: 0)."""

    def record(self, replica: str, request: RouteRequest) -> None:
        """The request went to `replica` (a policy without memory ignores it)."""

    def retain(self, replicas: Collection[str]) -> None:
        """Only `replicas` are left: forget anything kept about the others."""


class RoundRobin(RoutingPolicy):
    """The replicas in sorted order, starting one further each call: equal shares, blind to load and cache."""

    def __init__(self) -> None:
        self.turn = 0

    def rank(self, replicas: Sequence[str], loads: Mapping[str, int], request: RouteRequest) -> list[str]:
        order = sorted(replicas)
        start = self.turn % len(order) if order else 0
        self.turn += 1
        return order[start:] + order[:start]


class LeastLoaded(RoutingPolicy):
    """Fewest requests in flight first; ties taken in round-robin order, so an idle pool still shares the work."""

    def __init__(self) -> None:
        self.ties = RoundRobin()

    def rank(self, replicas: Sequence[str], loads: Mapping[str, int], request: RouteRequest) -> list[str]:
        return sorted(self.ties.rank(replicas, loads, request), key=lambda r: loads.get(r, 0))


class LoadGuard:
    """Where an affinity policy gives way to load: a replica with more than `balance_abs_threshold` requests
    more than the least-loaded replica, and more than `balance_rel_threshold` times as many (SGLang's two
    thresholds), is overloaded."""

    balance_abs_threshold: int
    balance_rel_threshold: float

    def overloaded(self, replica: str, loads: Mapping[str, int], replicas: Sequence[str]) -> bool:
        """Whether the replica's queue exceeds the shortest by more than both thresholds."""
        load, least = loads.get(replica, 0), min(loads.get(r, 0) for r in replicas)
        return load - least > self.balance_abs_threshold and load > self.balance_rel_threshold * least


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hash of each full block of `token_ids`, exactly as the engine's prefix cache keys its blocks."""
    hashes, prev = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = block_hash(prev, tuple(token_ids[start:start + block_size]))
        hashes.append(prev)
    return hashes


class PrefixAffinity(RoutingPolicy, LoadGuard):
    """Send a prompt to the replica most likely to hold its prefix in cache, unless that replica is overloaded.

    Per replica, a record of the block hashes it was sent: least recently sent dropped first past
    `capacity` blocks, the replica's KV pool size being the natural choice. A prompt matches a replica by the
    number of its leading blocks in that record. The replica with the longest match wins (ties: the least
    loaded) if the match covers at least `match_threshold` of the prompt's full blocks and the replica is not
    overloaded (`LoadGuard`). Otherwise the least-loaded replica wins (ties: the
    one with the smallest record, so new prefixes spread). The rest follow in least-loaded order.
    """

    def __init__(self, block_size: int = 16, capacity: int = 4096, match_threshold: float = 0.5,
                 balance_abs_threshold: int = 4, balance_rel_threshold: float = 1.5):
        if block_size < 1 or capacity < 1:
            raise ValueError(f"block_size ({block_size}) and capacity ({capacity}) must be positive")
        self.block_size, self.capacity, self.match_threshold = block_size, capacity, match_threshold
        self.balance_abs_threshold, self.balance_rel_threshold = balance_abs_threshold, balance_rel_threshold
        self.records: dict[str, OrderedDict[bytes, None]] = {}

    def matched_blocks(self, replica: str, hashes: Sequence[bytes]) -> int:
        """How many of the leading `hashes` the replica's record holds, up to the first it lacks."""
        record = self.records.get(replica, {})
        return next((i for i, h in enumerate(hashes) if h not in record), len(hashes))

    def rank(self, replicas: Sequence[str], loads: Mapping[str, int], request: RouteRequest) -> list[str]:
        by_load = sorted(replicas, key=lambda r: (loads.get(r, 0), len(self.records.get(r, ()))))
        hashes = prefix_block_hashes(request.prompt_token_ids, self.block_size)
        if not by_load or not hashes:
            return by_load
        matches = {r: self.matched_blocks(r, hashes) for r in by_load}
        best = max(by_load, key=matches.__getitem__)  # the first of the longest: the least loaded of them
        if matches[best] == 0 or matches[best] < self.match_threshold * len(hashes) \
                or self.overloaded(best, loads, replicas):
            return by_load
        return [best] + [r for r in by_load if r != best]

    def record(self, replica: str, request: RouteRequest) -> None:
        """Note the prompt's blocks as the replica's most recent, the first block newest: a prefix shared by
        many prompts outlives their tails, as a radix tree evicts leaves first."""
        record = self.records.setdefault(replica, OrderedDict())
        for h in reversed(prefix_block_hashes(request.prompt_token_ids, self.block_size)):
            record[h] = None
            record.move_to_end(h)
        while len(record) > self.capacity:
            record.popitem(last=False)

    def retain(self, replicas: Collection[str]) -> None:
        self.records = {r: record for r, record in self.records.items() if r in replicas}


def _ring_point(key: str) -> int:
    """A position on the hash ring: the first 8 bytes of the key's SHA-256."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


class SessionAffinity(RoutingPolicy, LoadGuard):
    """A user's requests go to one replica, found by consistent hashing; requests without a user, and a user's
    requests while that replica is overloaded (`LoadGuard`, as for prefixes), go to the least loaded.

    Each replica owns `virtual_nodes` points on a ring; a user belongs to the first point at or after the
    user's own. The ranking walks on round the ring, so when a replica leaves, only its users move (each to
    the replica its point led to next), and a full replica's users overflow to the same next replica.
    """

    def __init__(self, virtual_nodes: int = 64, balance_abs_threshold: int = 4, balance_rel_threshold: float = 1.5):
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes ({virtual_nodes}) must be positive")
        self.virtual_nodes = virtual_nodes
        self.balance_abs_threshold, self.balance_rel_threshold = balance_abs_threshold, balance_rel_threshold
        self.fallback = LeastLoaded()
        self._rings: dict[tuple[str, ...], tuple[list[int], list[str]]] = {}

    def ring(self, replicas: Sequence[str]) -> tuple[list[int], list[str]]:
        """The sorted ring points of these replicas and the replica owning each (cached per replica set)."""
        key = tuple(sorted(set(replicas)))
        if key not in self._rings:
            points = sorted((_ring_point(f"{r}#{i}"), r) for r in key for i in range(self.virtual_nodes))
            self._rings = {key: ([p for p, _ in points], [r for _, r in points])}  # one set live at a time
        return self._rings[key]

    def rank(self, replicas: Sequence[str], loads: Mapping[str, int], request: RouteRequest) -> list[str]:
        if request.user is None or not replicas:
            return self.fallback.rank(replicas, loads, request)
        points, owners = self.ring(replicas)
        start = bisect.bisect_left(points, _ring_point(request.user))
        walk = list(dict.fromkeys(owners[(start + i) % len(owners)] for i in range(len(owners))))
        if self.overloaded(walk[0], loads, replicas):
            return self.fallback.rank(replicas, loads, request)
        return walk
