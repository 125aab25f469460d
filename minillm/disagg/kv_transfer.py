"""Chapter 9 — the wire between a prefill and a decode instance, and what a transfer over it records.

The handle that names a prefilled request (`KVTransferParams`, in the core's `kv_handoff.py`) is small; the K/V
themselves travel separately, over the two instances' own gloo group on 127.0.0.1, when the decode side pulls
them (connector.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from ..parallel.comm import Comm, loopback_store
from ..parallel.state import new_group

PREFILL_RANK, DECODE_RANK = 0, 1
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


def pair_comm(rank: int, port: int) -> Comm:
    """The two instances' gloo group (prefill rank 0, decode rank 1), rendezvous on 127.0.0.1:`port`, connections
    on the loopback interface only; its bytes counted by `Comm`."""
    return Comm(new_group("gloo", loopback_store(rank, 2, port), rank, 2, GROUP_TIMEOUT))
