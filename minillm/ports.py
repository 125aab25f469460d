"""Chapter 7 — a free TCP port for a server that binds it a moment later: a process group's rendezvous (chapter 7),
Serve's proxy and Triton's endpoints (chapter 9), the benchmarks' llama.cpp servers.

A port the kernel picks (binding port 0) comes from its ephemeral range, the one it also gives every outgoing
connection, so between the pick and the server's bind another connection can take it: a starting Ray instance opens
many, and Serve's proxy once failed to bind that way. The port is drawn from below that range instead, and above
Ray's worker ports, where only a server asking for that very port could take it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20000  # above Ray's worker ports (10002-19999 by default) and the usual servers' fixed ports
DRAWS = 50


def ephemeral_start() -> int:
    """The first port of the kernel's range for outgoing connections (Linux's default where it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that no socket holds now, drawn at random between `LOWEST` and the ephemeral range; one the
    kernel picks where that leaves no room or every draw is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    top, draw = ephemeral_start(), random.SystemRandom()  # not the seeded generator forked processes share
    for _ in range(DRAWS if top > LOWEST else 0):
        port = draw.randrange(LOWEST, top)
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
