"""Chapter 0 — the minillm package: a small, real LLM inference engine, built chapter by chapter.

The engine's names are imported on first use, so `import minillm.metrics` (records and summaries, used
by benchmark clients) does not load PyTorch, transformers and the engine.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"LLM": ".llm", "LLMEngine": ".engine", "EngineArgs": ".engine_args", "SamplingParams": ".sampling",
            "RequestOutputKind": ".sampling", "StructuredOutputsParams": ".sampling", "RequestOutput": ".outputs",
            "CompletionOutput": ".outputs", "Logprob": ".outputs"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'minillm' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
