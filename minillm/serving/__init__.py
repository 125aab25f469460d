"""Chapter 8 — serving: the engine behind an asyncio loop (`AsyncLLM`) and an OpenAI-compatible HTTP server.

`from minillm.serving import AsyncLLM, ServerThread, build_app`. Names are imported on first use, so that chapter
9's service (`minillm.service`) can use this package's middleware and schemas without loading the whole server.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"build_app": ".api_server", "ServerThread": ".launch", "serve": ".launch", "ServerLimits": ".limits",
            **dict.fromkeys(["AsyncLLM", "EngineDeadError", "EngineOverloaded", "EngineUnavailable", "RequestFailed",
                             "RequestStream"], ".async_llm")}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'minillm.serving' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
