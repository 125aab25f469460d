"""Chapter 8 — serving: the engine behind an asyncio loop (`AsyncLLM`) and an OpenAI-compatible HTTP server."""

from .api_server import build_app
from .async_llm import (AsyncLLM, EngineDeadError, EngineOverloaded, EngineUnavailable, RequestFailed,
                        RequestStream)
from .launch import ServerThread, serve
from .limits import ServerLimits

__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloaded", "EngineUnavailable", "RequestFailed", "RequestStream",
           "ServerLimits", "ServerThread", "build_app", "serve"]
