"""Chapter 9 — the wire between prefill and decode instances, and what a transfer over it records.

The handle that names a prefilled request (`KVTransferParams`, in the core's `kv_handoff.py`) is small; the K/V
themselves travel separately, over the instances' own gloo group on 127.0.0.1, when a decode instance pulls them
(connector.py). In a pool of P prefill and D decode instances, prefill instance i is rank i and decode instance j
is rank P + j; every prefill instance can send to every decode instance.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from ..parallel.comm import Comm, loopback_store
from ..parallel.state import new_group

# A prefill instance waits for pulls as long as it is idle, so its group never times out by itself; a peer that
# dies closes its sockets, which ends any wait at once with an error.
GROUP_TIMEOUT = timedelta(days=1)


@dataclass
class TransferRecord:
    """One request's K/V transfer as one side saw it: blocks and bytes sent, and the seconds it took (for the
    decode side, from asking to having every byte; for the prefill side, from the request to the last byte sent)."""

    request_id: str
    num_blocks: int
    nbytes: int
    seconds: float


def pd_ranks(num_prefill: int, num_decode: int) -> tuple[list[int], list[int]]:
    """The ranks of a pool's prefill instances and of its decode instances."""
    return list(range(num_prefill)), list(range(num_prefill, num_prefill + num_decode))


def pd_comm(rank: int, world_size: int, port: int) -> Comm:
    """The instances' gloo group, rendezvous on 127.0.0.1:`port`, connections on the loopback interface only; its
    bytes counted by `Comm`."""
    return Comm(new_group("gloo", loopback_store(rank, world_size, port), rank, world_size, GROUP_TIMEOUT))
