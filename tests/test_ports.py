"""The free port handed to a server that binds it later lies outside the kernel's range for outgoing connections."""

from __future__ import annotations

import socket

from minillm import ports


def test_free_port_lies_below_the_ephemeral_range_and_binds():
    start = ports.ephemeral_start()
    seen = set()
    for _ in range(20):
        port = ports.free_port()
        if start > ports.LOWEST:
            assert ports.LOWEST <= port < start
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: the server can take it
        seen.add(port)
    assert len(seen) > 1  # drawn, not one fixed port that two processes would both pick


def test_a_held_port_is_not_drawn_and_the_kernel_picks_when_there_is_no_room(monkeypatch):
    start = ports.ephemeral_start()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "LOWEST", taken)
        monkeypatch.setattr(ports, "ephemeral_start", lambda: taken + 1)  # the one port in range is held
        port = ports.free_port()
        assert port != taken
    monkeypatch.setattr(ports, "ephemeral_start", lambda: 1024)  # a range that leaves no room below it
    assert ports.free_port() >= start  # the kernel's pick, from its own range
