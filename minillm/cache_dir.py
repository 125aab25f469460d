"""Chapter 2 — the one directory where minillm keeps what it builds once: converted models and compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models and compiled kernels live: `$MINILLM_CACHE`, default `~/.cache/minillm`."""
    return Path(os.environ.get("MINILLM_CACHE", Path.home() / ".cache" / "minillm"))
