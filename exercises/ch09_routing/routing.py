"""Exercise 9 — prefix-affinity routing with a load guard: send a prompt where its prefix is cached, unless that
replica is overloaded.

Replace each `raise NotImplementedError(...)` with your code, then run `make grade CH=09`.
Plain Python is enough; do not import minillm.service.routing_policies (that is what you are rebuilding).
`block_hash` (the engine's chained SHA-256 of one KV block) and `RouteRequest` are given.

Several replicas of one engine serve the same model, each with its own prefix cache. A prompt whose leading
blocks a replica has already computed skips that part of its prefill there, and nowhere else. The router
cannot see the replicas' caches, so it keeps an approximate record of what it sent to each (as SGLang's
router does) and ranks the replicas for each request:

1. The prompt's full blocks of `block_size` tokens are hashed exactly as the engine keys its prefix cache
   (`prefix_block_hashes`). A replica *matches* the prompt by the number of leading hashes its record holds,
   counting from the first block and stopping at the first one it lacks (`matched_blocks`).
2. Replicas in *least-loaded order*: sorted by load (`loads.get(replica, 0)`: requests queued or running),
   then by the number of hashes in their record (fewest first, so new prefixes spread), then by their
   position in `replicas` (a stable sort on `(load, record size)` does all three).
3. The *candidate* is the replica with the longest match; among equal matches, the first in least-loaded
   order. It goes first if its match is at least one block and at least `match_threshold` times the prompt's
   number of full blocks, and it is not overloaded (below). The others follow in least-loaded order.
4. Otherwise (no full block in the prompt, too short a match, or an overloaded candidate), the ranking is
   simply the least-loaded order.
5. A replica is *overloaded* when its load exceeds the lowest load among `replicas` by more than
   `balance_abs_threshold` AND is more than `balance_rel_threshold` times that lowest load (SGLang's two
   thresholds). Without this guard one popular system prompt piles every request onto one replica.
6. After the request is sent, `record(replica, request)` notes its block hashes in that replica's record,
   as the most recently used, the prompt's FIRST block the newest (so walk the hashes from the last to the
   first, moving each to the newest end). Then, while the record holds more than `capacity` hashes, the least
   recently used is dropped. A prefix shared by many prompts so outlives their tails (as a radix tree evicts
   leaves first), and the record never outgrows the replica's KV pool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from minillm.block_manager import block_hash
from minillm.service.routing_policies import RouteRequest


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hash of each full block of `token_ids`, in order: the first is `block_hash(None, block 0)`, each
    next `block_hash(previous hash, its block)`, where a block is a tuple of `block_size` ints. A last partial
    block is not hashed: prefix_block_hashes(list(range(37)), 16) has 2 hashes, and fewer than 16 tokens give []."""
    raise NotImplementedError("prefix_block_hashes: write this function")


class PrefixAffinity:
    """Ranks replicas (string ids) for a request by the longest cached prefix, with a load guard.

    Attributes:
        block_size, capacity, match_threshold, balance_abs_threshold, balance_rel_threshold   as given
        records   replica id -> its record, an ordered collection of block hashes, oldest first
                  (an `OrderedDict[bytes, None]` is the natural choice); a replica never recorded has none
    """

    def __init__(self, block_size: int = 16, capacity: int = 4096, match_threshold: float = 0.5,
                 balance_abs_threshold: int = 4, balance_rel_threshold: float = 1.5):
        """Keep the parameters and start with no records. ValueError if block_size or capacity is below 1."""
        raise NotImplementedError("PrefixAffinity.__init__: write this method")

    def matched_blocks(self, replica: str, hashes: Sequence[bytes]) -> int:
        """How many of the leading `hashes` the replica's record holds, up to the first one it lacks (0 if it has
        no record)."""
        raise NotImplementedError("PrefixAffinity.matched_blocks: write this method")

    def overloaded(self, replica: str, loads: Mapping[str, int], replicas: Sequence[str]) -> bool:
        """Whether the replica's load exceeds the lowest load among `replicas` by more than balance_abs_threshold
        and is more than balance_rel_threshold times that lowest load (a missing load is 0)."""
        raise NotImplementedError("PrefixAffinity.overloaded: write this method")

    def rank(self, replicas: Sequence[str], loads: Mapping[str, int], request: RouteRequest) -> list[str]:
        """Every replica in `replicas` once, the preferred first, by rules 1 to 5 of the module docstring.
        Reads only `request.prompt_token_ids`; changes no record."""
        raise NotImplementedError("PrefixAffinity.rank: write this method")

    def record(self, replica: str, request: RouteRequest) -> None:
        """The request went to `replica`: note its prompt's block hashes in the replica's record (rule 6)."""
        raise NotImplementedError("PrefixAffinity.record: write this method")
