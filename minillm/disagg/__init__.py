"""Chapter 9 — prefill/decode disaggregation: one engine prefills, another decodes, the KV cache moves between.

`from minillm.disagg import PDPair`. Names are imported on first use: the engine imports the connector, so this
package must not import the engine back while it loads.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"PDPair": ".pair", "KVConnector": ".connector", "KVTransferParams": "..kv_handoff",
            "KVLayout": "..kv_handoff", "TransferRecord": ".kv_transfer"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'minillm.disagg' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
