"""A solution to exercise 9 written from the stub's docstrings alone, never from minillm.

`python -m exercises.selfcheck` grades it: full marks prove that the stub says everything the grader checks.
It lives in its own folder so that the stub finder sees one student file.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from minillm.block_manager import block_hash
from minillm.service.routing_policies import RouteRequest


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of the full blocks, first to last."""
    hashes: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        hashes.append(block_hash(hashes[-1] if hashes else None, tuple(token_ids[i * block_size:(i + 1) * block_size])))
    return hashes


class PrefixAffinity:
    """Longest recorded prefix first, unless overloaded; least-loaded order otherwise."""

    def __init__(self, block_size: int = 16, capacity: int = 4096, match_threshold: float = 0.5,
                 balance_abs_threshold: int = 4, balance_rel_threshold: float = 1.5):
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.block_size = block_size
        self.capacity = capacity
        self.match_threshold = match_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.records: dict[str, OrderedDict[bytes, None]] = {}

    def matched_blocks(self, replica: str, hashes: Sequence[bytes]) -> int:
        record = self.records.get(replica)
        if record is None:
            return 0
        count = 0
        for h in hashes:
            if h not in record:
                break
            count += 1
        return count

    def overloaded(self, replica: str, loads: Mapping[str, int], replicas: Sequence[str]) -> bool:
        lowest = min(loads.get(r, 0) for r in replicas)
        load = loads.get(replica, 0)
        return load - lowest > self.balance_abs_threshold and load > self.balance_rel_threshold * lowest

    def _record_size(self, replica: str) -> int:
        return len(self.records.get(replica, ()))

    def rank(self, replicas: Sequence[str], loads: Mapping[str, int], request: RouteRequest) -> list[str]:
        order = sorted(replicas, key=lambda r: (loads.get(r, 0), self._record_size(r)))
        hashes = prefix_block_hashes(request.prompt_token_ids, self.block_size)
        if not hashes:
            return order
        candidate, best = None, -1
        for r in order:
            m = self.matched_blocks(r, hashes)
            if m > best:
                candidate, best = r, m
        if best >= 1 and best >= self.match_threshold * len(hashes) and not self.overloaded(candidate, loads, replicas):
            return [candidate] + [r for r in order if r != candidate]
        return order

    def record(self, replica: str, request: RouteRequest) -> None:
        record = self.records.setdefault(replica, OrderedDict())
        for h in reversed(prefix_block_hashes(request.prompt_token_ids, self.block_size)):
            record[h] = None
            record.move_to_end(h)
        while len(record) > self.capacity:
            record.popitem(last=False)
